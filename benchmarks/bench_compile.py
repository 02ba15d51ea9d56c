"""The compiled training step against the eager one, estimator by estimator, on a CPU.

    python benchmarks/bench_compile.py [--rounds 10] [--block 20] [--threads 1] [--sizes checkerboard frey digits] [--out table.md]
    python benchmarks/bench_compile.py --smoke     # two checkerboard cases, one round: a check, not a timing

Each case is a bundled recipe built as ``eblvm run`` builds it (``eblvm.prepare``, ``[run] compile =
true``, schedules as the recipe has them), in a process of its own. A first process compiles the
step with an empty inductor cache (``TORCHINDUCTOR_CACHE_DIR`` a new folder: the cold compile, as a
new user meets it), a second compiles it again with that cache (the warm compile) and times, in
each of ``--rounds`` rounds on the same state so that a drift in the machine's speed hits all
alike, ``--block`` steps of each of:

- eager: the estimator's own step;
- compiled: the compiled step, its random draws taken before each call;
- graph: the compiled graphs alone (``CompiledStep.replay``), on the draws taken last;
- loop: the step as the training loop takes it (``Trainer.step``: the rates, the batch, the
  compiled step, the averages, the metric sums).

Reported: the median of each, eager / compiled, loop / graph, the compile times (the trace, then
inductor) and the largest relative difference between one compiled and one eager step from the
same state and seed (float rounding). An estimator that does not compile is listed with why, its
eager step timed in the first process.
Frey-face size uses a random stand-in of the data file; digits, scikit-learn's.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import scipy.io

ROOT = Path(__file__).resolve().parents[1]
CHECKERBOARD = [
    ("exact-score DSM", "grbm_dsm.toml", []),
    ("exact-score SSM", "grbm_ssm.toml", []),
    ("exact-score KSD", "grbm_ksd.toml", []),
    ("BiDSM (K=5, N=5, sgd)", "grbm_bidsm.toml", ['estimator.unroll="sgd"']),
    ("BiDSM (K=5, N=5, adam)", "grbm_bidsm.toml", ['estimator.unroll="adam"']),
    ("BiSSM (K=5, N=5): the main job", "grbm_bissm.toml", []),
    ("BiSSM, cosine rate", "grbm_bissm.toml", ['optim.model.schedule.kind="cosine"']),
    ("BiSM implicit (K=5, Neumann 40)", "grbm_bism_implicit.toml", ["estimator.fixed_iterations=false"]),
    ("BiSM implicit (K=5, Neumann 40, fixed)", "grbm_bism_implicit.toml", ["estimator.fixed_iterations=true"]),
    ("VaGES-DSM (L=2, K=5)", "grbm_vagesdsm.toml", []),
    ("VaGES-KSD (L=2, K=5)", "grbm_vagesksd.toml", []),
    ("IS-KSD", "grbm_isksd.toml", []),
    ("CD-1", "grbm_cd.toml", []),
    ("PCD", "grbm_pcd.toml", []),
    ("NCE", "grbm_nce.toml", []),
    ("VNCE", "grbm_vnce.toml", []),
]
FREY = [
    ("exact-score DSM", "freyface_dsm.toml", []),
    ("BiDSM (K=5, N=5, adam)", "freyface_bidsm.toml", []),
    ("VaGES-DSM (L=2, K=5)", "freyface_vagesdsm.toml", []),
]
DIGITS = [
    ("BiMDSM (K=5, N=0)", "digits_bimdsm.toml", []),
    ("MDSM EBM (exact score)", "digits_mdsm.toml", []),
    ("BiDVL (N=1)", "digits_bidvl.toml", []),
]
SIZES = {"checkerboard": CHECKERBOARD, "frey": FREY, "digits": DIGITS}


def frey_stand_in(folder: Path) -> Path:
    """A random uint8 (560, 1965) array under key 'ff', the format of frey_rawface.mat."""
    rng = np.random.default_rng(0)
    scipy.io.savemat(folder / "frey_rawface.mat", {"ff": rng.integers(0, 256, (560, 1965), dtype=np.uint8)})
    return folder


def measure(recipe: str, overrides: list[str], rounds: int, block: int, threads: int, cold: bool) -> dict:
    """In this process: build the case with its step compiled (timed), check one compiled step
    against one eager step, then time the four kinds of step in interleaved rounds (``cold``: one
    step of each, the compile being what is measured; a step that does not compile is timed anyway)."""
    from eblvm_core.startup import pause_gc

    pause_gc()  # torch loaded as `eblvm run` loads it; the build resumes the collector
    import torch

    import eblvm
    from eblvm_core import checkpoint as ckpt
    from eblvm_core.errors import ConfigError
    from eblvm_core.plan import numerics
    from eblvm_core.trainer import Trainer

    options = [*overrides, "~eval", "run.seed=0", 'run.device="cpu"', f"run.threads={threads}"]
    start = time.perf_counter()
    try:
        prepared = eblvm.prepare(ROOT / "recipes" / recipe, overrides=[*options, "run.compile=true"], echo=None)
    except ConfigError as exc:
        prepared = eblvm.prepare(ROOT / "recipes" / recipe, overrides=[*options, "run.compile=false"], echo=None)
        refusal = str(exc).split("cannot be compiled: ", 1)[-1]
        result = {"refused": refusal}
        compiled = None
    else:
        compiled = prepared.compiled
        rounds, block = (1, 1) if cold else (rounds, block)
        result = {
            "compile_s": time.perf_counter() - start,
            "trace_s": compiled.trace_s,
            "inductor_s": compiled.compile_s,
        }
    estimator, state = prepared.parts.estimator, prepared.state
    batch = state.batches.next()
    with numerics(prepared.plan):
        steps = {"eager": estimator.step}
        if compiled is not None:
            rates = len(compiled.rates.tensors()) if compiled.rates is not None else 0
            tensors = compiled.tensors[: len(compiled.tensors) - rates]  # the state, not the rates' inputs
            begin, rng = [t.detach().clone() for t in tensors], ckpt.rng_state()
            estimator.step(batch)
            eager = [t.detach().clone() for t in tensors]
            with torch.no_grad():
                for t, value in zip(tensors, begin):
                    t.copy_(value)
            ckpt.set_rng_state(rng)
            compiled(batch)
            result["difference"] = max(
                float((a - b).abs().max() / max(float(b.abs().max()), 1e-30)) for a, b in zip(tensors, eager)
            )
            trainer = Trainer(prepared.recipe, state, estimator_step=compiled)
            steps.update({"compiled": compiled, "graph": compiled.replay, "loop": lambda _b: trainer.step()})
        medians: dict[str, list[float]] = {name: [] for name in steps}
        for step in steps.values():  # warm-up
            for _ in range(2):
                step(batch)
        for _ in range(rounds):
            for name, step in steps.items():
                times = []
                for _ in range(block):
                    begin_step = time.perf_counter()
                    step(batch)
                    times.append(time.perf_counter() - begin_step)
                medians[name].append(statistics.median(times))
        result.update({f"{name}_ms": 1000 * statistics.median(values) for name, values in medians.items()})
    return result


def run_case(recipe: str, overrides: list[str], cache: Path, rounds: int, block: int, threads: int, cold: bool) -> dict:
    """``measure`` in a new process whose inductor cache is ``cache``."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    args = [sys.executable, __file__, "--one", json.dumps([recipe, overrides, rounds, block, threads, cold])]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--block", type=int, default=20, help="timed steps of each kind per round (a tenth at Frey and digits size)"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--only", nargs="+", default=None, help="only the cases whose name contains one of these")
    parser.add_argument("--out", type=Path, default=None, help="write a Markdown table here")
    parser.add_argument("--smoke", action="store_true", help="two small checkerboard cases, one round of one step")
    parser.add_argument(
        "--one", help=argparse.SUPPRESS
    )  # a case in this process: [recipe, overrides, rounds, block, threads, cold]
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(*json.loads(args.one))))
        return
    cases = [(size, name, recipe, overrides) for size in args.sizes for name, recipe, overrides in SIZES[size]]
    if args.only:
        cases = [case for case in cases if any(part in case[1] for part in args.only)]
    if args.smoke:
        args.rounds, args.block = 1, 1
        cases = [
            ("checkerboard", name, recipe, ["run.batch_size=10", *o])
            for name, recipe, o in (CHECKERBOARD[0], CHECKERBOARD[7])
        ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        frey = [f'data.root="{frey_stand_in(Path(tmp))}"']
        for i, (size, name, recipe, overrides) in enumerate(cases):
            overrides = overrides + (frey if size == "frey" else [])
            block = max(1, args.block // 10) if size != "checkerboard" else args.block
            cache = Path(tmp) / f"inductor-{i}"
            cold = run_case(recipe, overrides, cache, args.rounds, block, args.threads, cold=True)
            if "refused" in cold:  # timed eagerly already: there is no warm compile
                warm = cold
            else:
                warm = run_case(recipe, overrides, cache, args.rounds, block, args.threads, cold=False)
            rows.append((size, name, cold, warm))
            print(size, name, json.dumps({"cold": cold, "warm": warm}), flush=True)
    if args.out:
        args.out.write_text(table(rows, args))


def table(rows: list[tuple[str, str, dict, dict]], args: argparse.Namespace) -> str:
    lines = [
        "| size | estimator | eager (ms) | compiled (ms) | graph (ms) | loop (ms) | eager / compiled | loop / graph | "
        "compile cold (s) | compile warm (s) | one step's largest relative difference |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size, name, cold, warm in rows:
        if "error" in warm or "error" in cold:
            lines.append(f"| {size} | {name} | failed: {warm.get('error') or cold.get('error')} |" + " |" * 9)
        elif "refused" in warm:
            lines.append(f"| {size} | {name} | {warm['eager_ms']:.2f} | not compiled: {warm['refused']} |" + " |" * 8)
        else:
            lines.append(
                f"| {size} | {name} | {warm['eager_ms']:.2f} | {warm['compiled_ms']:.3f} | {warm['graph_ms']:.3f} | "
                f"{warm['loop_ms']:.3f} | {warm['eager_ms'] / warm['compiled_ms']:.1f} | "
                f"{warm['loop_ms'] / warm['graph_ms']:.2f} | {cold['compile_s']:.1f} | {warm['compile_s']:.1f} | "
                f"{warm['difference']:.1e} |"
            )
    torch_version = importlib.metadata.version("torch")  # this process only starts the cases: no torch import
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch_version}"
    note = (
        f"Machine: {machine}; {args.threads} CPU thread(s). Median step over {args.rounds} interleaved rounds "
        "(eager, compiled, graph, loop, on the same state); compile times include the trace."
    )
    return "\n".join([note, "", *lines, ""])


if __name__ == "__main__":
    main()
