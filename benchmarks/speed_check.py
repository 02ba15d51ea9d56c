"""Speed per commit: ratios of eblvm's steps to hand-written steps of the same math, against a baseline.

    python benchmarks/speed_check.py                       # measure, write speed.json, compare with the baseline
    python benchmarks/speed_check.py --out speed.json --baseline benchmarks/speed_baseline.json --tolerance 1.5
    python benchmarks/speed_check.py --update              # measure and write the result as the new baseline
    python benchmarks/speed_check.py --smoke               # one short round, no comparison: a check, not a timing

One process, one CPU thread, about 30 s (most of it compiling the main job's step once). Every
case is timed in interleaved rounds (each round runs a block of steps of every case, so a drift
in the machine's speed hits all alike) on this thread's CPU clock (``time.thread_time``: blind to
the time the thread waits for a core on a busy machine), and each case's fastest step is divided
by the fastest hand-written step of its size, measured in the same rounds: ratios, not times, so
the baseline holds on another machine. The fastest step, not the median: a shared core slows a
step of thousands of small operations (cache, clock) far more than one compiled call, and the
fastest steps are those the other jobs disturbed least. The cases:

- main job, eager and compiled: ``recipes/grbm_bissm.toml`` built by ``eblvm.prepare`` as
  ``eblvm run`` builds it (``run.compile=false`` / ``true``: ``prepared.compiled``), against
  ``HandBiSSM``, the same BiSSM step (K = 5 real, N = 5 unrolled SGD steps, sliced score matching
  on the modified score) in plain torch;
- checkerboard BiDSM, eager: ``recipes/grbm_bidsm.toml`` against ``bench_overhead.HandStep``;
- Frey size, eager: ``recipes/freyface_bidsm.toml`` on a random stand-in of the data file
  (v = 560, h = 400, batch 100) against the same hand-written step at that size.

Before timing, one step of each eager case and of its hand-written twin from the same state and
seed must agree (parameters and gradients within 1e-6, relative), so each ratio compares the
same math. A ratio above ``tolerance`` times its baseline is a regression: listed, exit status 1.
A ratio below baseline / tolerance is listed as an improvement to record with ``--update``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from bench_overhead import HandStep, built_case, frey_stand_in, hand_from, relative
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "benchmarks" / "speed_baseline.json"
COMMON = ["~eval", "run.seed=0", 'run.device="cpu"', "run.threads=1"]


class HandBiSSM(HandStep):
    """The main job's step (``grbm_bissm``) in plain torch: ``HandStep``'s lower level (K real Adam
    steps, N differentiable SGD steps of the relaxed-Bernoulli KL) at the data points themselves,
    then sliced score matching with one Rademacher slice u on the modified score
    ŝ(x) = −∇_x[E(x, h) + log q(h|x)], h drawn at φ_N: ½‖ŝ‖² + uᵀ∇_x(uᵀŝ), then one Adam step of θ."""

    def __call__(self, v: Tensor) -> dict[str, Tensor]:
        x = v.flatten(1)
        for _ in range(self.k):
            lower = self.kl(x, self.phi)
            for p, g in zip(self.phi, torch.autograd.grad(lower, self.phi)):
                p.grad = g
            self.opt_phi.step()
        phi = self.phi
        for n in range(self.n):
            lower = self.kl(x, phi)
            if n == 0:
                lower_at_start = lower.detach()
            grads = torch.autograd.grad(lower, phi, create_graph=True)
            phi = [torch.add(p, g, alpha=-self.alpha) for p, g in zip(phi, grads)]
        h = self.relaxed(F.linear(x, *phi))[0]
        xg = x.detach().requires_grad_(True)
        logits = F.linear(xg, *phi)
        total = self.energy(xg, h) + (h * logits - F.softplus(logits)).sum(-1)
        (grad_x,) = torch.autograd.grad(total.sum(), xg, create_graph=True)
        score = -grad_x
        u = torch.randn((1, *score.shape), dtype=score.dtype)[0].sign()
        (jac,) = torch.autograd.grad((u * score).sum(), xg, create_graph=True)
        upper = (0.5 * (score**2).sum(1) + (u * jac).sum(1)).mean()
        for p, g in zip(self.theta, torch.autograd.grad(upper, self.theta)):
            p.grad = g
        self.opt_theta.step()
        return {"loss": upper.detach(), "lower_loss": lower_at_start}


def same_math(est: Any, hand: HandStep, batch: Tensor) -> float:
    """The largest relative difference of the parameters and of the gradients their updates used
    after one step of each from the same state and seed (both are left one step on)."""
    torch.manual_seed(1000)
    est.step(batch)
    torch.manual_seed(1000)
    hand(batch)
    ours = est.theta + list(est.phi.values())
    return max(
        max(relative(a.detach(), b.detach()), relative(a.grad, b.grad)) for a, b in zip(ours, hand.theta + hand.phi)
    )


def timed(step: Callable[[Tensor], Any], batch: Tensor, block: int) -> Callable[[], list[float]]:
    """One block of ``step``: its step times (s)."""

    def run() -> list[float]:
        times = []
        for _ in range(block):
            start = time.thread_time()
            step(batch)
            times.append(time.thread_time() - start)
        return times

    return run


def cases(
    folder: Path, block: int
) -> tuple[dict[str, Callable[[], list[float]]], dict[str, tuple[str, str]], dict[str, float]]:
    """(the timed cases, each ratio's (numerator, denominator), the same-math differences)."""
    import eblvm

    recipes = ROOT / "recipes"
    run: dict[str, Callable[[], list[float]]] = {}
    checks: dict[str, float] = {}

    # the main job: eager, compiled, hand-written
    eager = eblvm.prepare(recipes / "grbm_bissm.toml", overrides=[*COMMON, "run.compile=false"], echo=None)
    batch = eager.state.batches.next()
    hand = HandBiSSM(*hand_args(eager.parts.estimator))
    checks["main job"] = same_math(eager.parts.estimator, hand, batch)
    compiled = eblvm.prepare(recipes / "grbm_bissm.toml", overrides=[*COMMON, "run.compile=true"], echo=None)
    run["main hand-written"] = timed(hand, batch, block)
    run["main eager"] = timed(eager.parts.estimator.step, batch, block)
    run["main compiled"] = timed(compiled.compiled, batch, block)

    # the checkerboard BiDSM and one Frey-size step: eblvm's eager step and the hand-written one
    frey = [f'data.root="{frey_stand_in(folder)}"', *COMMON[1:]]
    for name, recipe, overrides, size_block in (
        ("checkerboard BiDSM", "grbm_bidsm.toml", COMMON, block),
        ("Frey BiDSM", "freyface_bidsm.toml", ['estimator.unroll="sgd"', *frey, "~eval"], max(1, block // 5)),
    ):
        spec, built, data = built_case(recipes / recipe, overrides)
        hand_step = hand_from(built, spec)
        checks[name] = same_math(built.parts.estimator, hand_step, data)
        run[f"{name} hand-written"] = timed(hand_step, data, size_block)
        run[f"{name} eager"] = timed(built.parts.estimator.step, data, size_block)
    ratios = {
        "main job eager / hand-written": ("main eager", "main hand-written"),
        "main job compiled / hand-written": ("main compiled", "main hand-written"),
        "checkerboard BiDSM eager / hand-written": ("checkerboard BiDSM eager", "checkerboard BiDSM hand-written"),
        "Frey BiDSM eager / hand-written": ("Frey BiDSM eager", "Frey BiDSM hand-written"),
    }
    return run, ratios, checks


def hand_args(est: Any) -> tuple[list[Tensor], list[Tensor], dict, dict, dict]:
    """``HandStep``'s arguments from a built BiSM estimator (``bench_overhead.hand_from``'s)."""
    from bench_overhead import adam_options

    model, posterior = est.model, est.posterior
    assert model.coupling == "plain" and len(posterior.net) == 1 and est.unroll == "sgd"
    hyper = {
        "sigma": None,
        "temperature": posterior.temperature,
        "inner_steps": est.inner_steps,
        "unroll_steps": est.unroll_steps,
        "inner_lr": est.inner_lr,
    }
    phi = [posterior.net[0].weight, posterior.net[0].bias]
    theta = [model.W, model.b, model.c, model.log_sigma]
    return theta, phi, adam_options(est.model_role.optimizer), adam_options(est.posterior_role.optimizer), hyper


def measure(rounds: int, block: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        run, ratios, checks = cases(Path(tmp), block)
        torch.set_num_threads(1)  # building a recipe sets its threads
        bad = {name: d for name, d in checks.items() if not d <= 1e-6}
        if bad:
            sys.exit(f"speed check: a hand-written step is not eblvm's math (relative difference {bad} > 1e-6)")
        for case in run.values():  # warm-up
            case()
        times: dict[str, list[float]] = {name: [] for name in run}
        for _ in range(rounds):
            for name, case in run.items():
                times[name] += case()
    fastest = {name: 1000 * min(values) for name, values in times.items()}
    ms = {name: 1000 * statistics.median(values) for name, values in times.items()}
    return {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "seconds": round(time.perf_counter() - start, 1),
        "rounds": rounds,
        "ratios": {name: round(fastest[a] / fastest[b], 4) for name, (a, b) in ratios.items()},
        "fastest_ms": {name: round(value, 4) for name, value in fastest.items()},
        "median_ms": {name: round(value, 4) for name, value in ms.items()},
        "same_math": {name: float(f"{d:.2e}") for name, d in checks.items()},
    }


def compare(result: dict[str, Any], baseline: dict[str, Any], tolerance: float) -> tuple[list[str], list[str]]:
    """(regressions, improvements): ratios beyond ``tolerance`` times their baseline either way."""
    worse, better = [], []
    for name, ratio in result["ratios"].items():
        base = baseline["ratios"].get(name)
        if base is None:
            better.append(f"{name}: {ratio:.3f}, not in the baseline")
        elif ratio > tolerance * base:
            worse.append(f"{name}: {ratio:.3f} against the baseline's {base:.3f} ({ratio / base:.2f}x)")
        elif ratio < base / tolerance:
            better.append(f"{name}: {ratio:.3f} against the baseline's {base:.3f} ({base / ratio:.2f}x faster)")
    return worse, better


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--block", type=int, default=10, help="timed steps per round (a fifth at Frey size)")
    parser.add_argument("--out", type=Path, default=Path("speed.json"), help="the run's ratios and times (JSON)")
    parser.add_argument("--baseline", type=Path, default=BASELINE)
    parser.add_argument("--tolerance", type=float, default=1.5, help="a ratio above tolerance x baseline fails")
    parser.add_argument("--update", action="store_true", help="write the result to --baseline instead of comparing")
    parser.add_argument("--smoke", action="store_true", help="one round of one step, no comparison")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.block = 1, 1
    result = measure(args.rounds, args.block)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"speed check ({result['machine']}, {result['rounds']} rounds, {result['seconds']} s): {args.out}")
    print("| ratio | this run | baseline |\n|---|---|---|")
    baseline = json.loads(args.baseline.read_text()) if args.baseline.is_file() else {"ratios": {}}
    for name, ratio in result["ratios"].items():
        base = baseline["ratios"].get(name)
        print(f"| {name} | {ratio:.3f} | {'' if base is None else f'{base:.3f}'} |")
    if args.update:
        args.baseline.write_text(json.dumps(result, indent=2) + "\n")
        print(f"baseline written: {args.baseline}")
        return
    if args.smoke:
        return
    worse, better = compare(result, baseline, args.tolerance)
    for line in better:
        print(f"faster: {line} (python benchmarks/speed_check.py --update records it)")
    if worse:
        print("\n".join(f"slower: {line}" for line in worse))
        sys.exit(f"speed check: {len(worse)} ratio(s) more than {args.tolerance}x their baseline")
    print(f"speed check: every ratio within {args.tolerance}x its baseline")


if __name__ == "__main__":
    main()
