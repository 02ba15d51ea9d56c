"""Step time and peak memory of the deep-EBLVM recipes (CIFAR-10 size) on one device.

    python benchmarks/bench_deep.py [--device cuda] [--steps 20] [--warmup 5] [--out table.md]
    python benchmarks/bench_deep.py --flops [--out flops.md]      # any device, the CPU will do
    python benchmarks/bench_deep.py --peak [--out peak.md]        # the device's measured matmul rate
    python benchmarks/bench_deep.py --profile [--cases 0 3] [--out profile.md]
    python benchmarks/bench_deep.py --smoke [--flops | --peak | --profile]   # tiny networks, batch 4: a check, not a timing

Each case builds a bundled recipe (its evaluators dropped) on random CIFAR-10- or MNIST-shaped
data (no data file needed) with ``eblvm.prepare``, warms up, then times ``--steps`` training steps
as the training loop takes them (``Prepared.step``: the rates, the batch of 100, the precision, the
estimator's step), synchronising the device after each; reported: the median and the 10th/90th percentiles of the
step times, the peak memory the device allocated during the timed steps, and how much of it is
parameters, gradients and optimizer states (the rest: activations and workspaces). On a CUDA device a
case whose plan replays it from a CUDA graph is timed a second time, replayed as ``eblvm run``
replays it (scheduled rates in device tensors), on freshly built parts; the eager timing sets
``run.cuda_graph = false``. Variants change the precision and
the memory format. Compare numbers only within one run on one card.

``--peak`` measures the rate the device reaches on one large square matrix product (fp32 with
TF32 allowed, as cuDNN's convolutions run by default, and bf16; fp32 only on a CPU): the peak the
FLOPs per update are divided by. ``--profile`` runs ``--steps`` eager steps of each case under
``torch.profiler`` and writes, per case, the operators that take the most device time (CPU time
on a CPU) with the profiler's totals: where a step's time goes, and how much of the wall time the
device spends idle between kernels (what a CUDA graph removes).

``--flops`` counts instead the floating-point operations of one update of each distinct case
(``torch.utils.flop_counter``'s formulas: matrix products and convolutions, forward and every backward
pass the update takes; elementwise work is not counted), after one warm-up update: a property
of the update, not of the device, so the CPU gives the numbers a GPU's step times divide.

Beside each case stand the papers' released code's step time and peak memory for the same
update, measured on one NVIDIA H100 80GB (torch 2.11, batch 100), and this project's target for
that card: the ratio column means something only on an H100.

``--smoke`` shrinks every case (batch 4, one thread; ResNets of width 8 with one block per stage; BiDVL's nets
of base 8; one lower-level step), times 2 steps after 1 of warm-up and multiplies a ``--peak`` product
down to 256 × 256: every case builds and steps in seconds on a CPU, and the numbers mean nothing.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

import eblvm
from eblvm_core.graphs import WARMUP_STEPS
from eblvm_core.recipe import read

ROOT = Path(__file__).resolve().parents[1]

CASES = [
    ("MDSM (exact score), fp32", "cifar10_mdsm.toml", ['run.precision="fp32"']),
    (
        "MDSM (exact score), fp32, channels-first",
        "cifar10_mdsm.toml",
        ['run.precision="fp32"', "model.channels_last=false"],
    ),
    ("MDSM (exact score), bf16", "cifar10_mdsm.toml", []),  # the recipe's precision
    ("BiMDSM (K=5, N=0), fp32", "cifar10_bimdsm.toml", []),
    ("BiMDSM (K=5, N=0), fp32, channels-first", "cifar10_bimdsm.toml", ["model.channels_last=false"]),
    ("VaGES-MDSM (L=2, K=5, 5 Langevin steps), fp32", "cifar10_vagesmdsm.toml", []),
    ("BiMDSM (K=5, N=0), bf16", "cifar10_bimdsm.toml", ['run.precision="bf16"']),
    ("VaGES-MDSM (L=2, K=5, 5 Langevin steps), bf16", "cifar10_vagesmdsm.toml", ['run.precision="bf16"']),
    ("BiDVL, conv nets (N=1), fp32", "cifar10_bidvl.toml", []),
    ("BiDVL, conv nets (N=1), bf16", "cifar10_bidvl.toml", ['run.precision="bf16"']),
    ("BiDVL, SNGAN ResNets, hinge (N=1), fp32", "cifar10_bidvl_resnet.toml", []),
    ("MNIST BiMDSM (K=5, N=0), fp32", "mnist_bimdsm.toml", []),
    ("MNIST MDSM (exact score), fp32", "mnist_mdsm.toml", []),
    ("MNIST BiMDSM (K=5, N=0), bf16", "mnist_bimdsm.toml", ['run.precision="bf16"']),
]


# case name -> (released code's median step in ms, its peak GiB, eblvm's target in ms), measured on one
# H100 (torch 2.11); BiDVL's released figure is its own training loop's, its target through `eblvm run`.
RELEASED_H100 = {
    "MDSM (exact score), fp32": (58.6, 5.40, 20.0),
    "BiMDSM (K=5, N=0), fp32": (111.5, 3.02, 37.0),
    "VaGES-MDSM (L=2, K=5, 5 Langevin steps), fp32": (None, None, 60.0),
    "BiDVL, conv nets (N=1), fp32": (50.3, 0.77, 17.0),
    "MNIST BiMDSM (K=5, N=0), fp32": (None, None, 3.3),  # ≥ 300 steps/s through `eblvm run`
}
RELEASED_H100.update(  # the same updates in bf16: the same reference and target
    {name.replace("fp32", "bf16"): figures for name, figures in RELEASED_H100.items()}
)


def reference_columns(name: str, median_ms: float, on_gpu: bool) -> str:
    """The released code's figures, eblvm's ratio to them (on a GPU only) and the target, as table cells."""
    released_ms, released_gib, target_ms = RELEASED_H100.get(name, (None, None, None))
    cells = [
        "" if released_ms is None else f"{released_ms:.1f}",
        "" if released_ms is None or not on_gpu else f"{median_ms / released_ms:.2f}",
        "" if released_gib is None else f"{released_gib:.2f}",
        "" if target_ms is None else f"≤ {target_ms:g}",
    ]
    return " | ".join(cells)


def fake_cifar(folder: Path, n: int = 1000) -> Path:
    """Random uint8 images in the npz layout the cifar10 data set reads, and in MNIST's idx files."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
    np.savez(folder / "fake.npz", x_train=x, y_train=np.zeros(n), x_test=x[:100], y_test=np.zeros(100))
    raw = folder / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix, count in (("train", n), ("t10k", 100)):
        images = rng.integers(0, 256, (count, 28, 28), dtype=np.uint8)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(idx_bytes(images))
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(idx_bytes(np.zeros(count, dtype=np.uint8)))
    return folder


def idx_bytes(array: np.ndarray) -> bytes:
    """An idx file of unsigned bytes: two zero bytes, type 0x08, the rank, big-endian sizes, the data."""
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + array.tobytes()


SMOKE = False  # --smoke: every case shrunk by ``tiny``


def tiny(raw: dict) -> list[str]:
    """Overrides that shrink a deep recipe to seconds on a CPU: batch 4, one thread, ResNets of width 8
    with one block per stage, BiDVL's energy, encoder and generator of base 8, one lower-level step."""
    overrides = ["run.batch_size=4", "run.threads=1"]
    if "inner_steps" in raw.get("estimator", {}):
        overrides.append("estimator.inner_steps=1")
    if str(raw["model"]["kind"]).startswith("resnet"):
        overrides += ['model.preset="custom"', "model.width=8", "model.blocks=1"]
    overrides += [
        f"{section}.base=8" for section in ("model", "posterior", "generator") if "base" in raw.get(section, {})
    ]
    return overrides


def build_case(recipe: str, overrides: list[str], root: Path, device: torch.device, graphed: bool = False) -> Any:
    """A case built as ``eblvm run`` builds it on the fake data in ``root`` (``eblvm.Prepared``),
    replayed from a CUDA graph where its plan says so when ``graphed``, else eager."""
    shrink = tiny(read(ROOT / "recipes" / recipe)) if SMOKE else []
    options = [
        *overrides,
        *shrink,
        f'data.root="{root}"',
        "~eval",
        "run.seed=0",
        "run.compile=false",  # the eager step on a CPU too (bench_compile.py times the compiled one)
        f"run.cuda_graph={str(graphed).lower()}",
    ]
    return eblvm.prepare(ROOT / "recipes" / recipe, overrides=options, device=str(device), echo=None)


class FlopCount(TorchDispatchMode):
    """Sums ``flop_counter.flop_registry``'s count of every operator that runs inside it (FlopCounterMode's
    formulas without its module hooks, which ``autograd.grad`` on a leaf input does not allow)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            self.total += count(*args, **kwargs, out_val=out)
        return out


def count_flops(recipe: str, overrides: list[str], root: Path, device: torch.device) -> int:
    """Floating-point operations of one update (after one warm-up update)."""
    case = build_case(recipe, overrides, root, device)
    case.step()
    with FlopCount() as counter:
        case.step()
    return counter.total


def time_case(
    recipe: str, overrides: list[str], root: Path, device: torch.device, steps: int, warmup: int, graphed: bool
) -> tuple[list[float], int, int] | None:
    """Step times (s), peak memory and the bytes of parameters, gradients and optimizer states
    (``state_bytes``) of one case, eager or (``graphed``) replayed from a CUDA graph; None when
    graphed and the trainer would not capture this case's step."""
    case = build_case(recipe, overrides, root, device, graphed)
    if graphed and case.plan.cuda_graph is not None:
        return None

    def step() -> None:
        case.step()
        synchronize(device)

    for _ in range(max(warmup, WARMUP_STEPS + 1) if graphed else warmup):  # a graph: warm-up calls and the capture
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    return times, peak, state_bytes(role.optimizer for role in case.roles.values())


def state_bytes(optimizers: Any) -> int:
    """Bytes of what lives across steps: the optimized parameters, their gradients and the
    optimizers' states (Adam's moments); the rest of a step's peak is its activations and workspaces."""
    tensors: dict[int, Tensor] = {}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                tensors[id(p)] = p
                if p.grad is not None:
                    tensors[id(p.grad)] = p.grad
        for state in optimizer.state.values():
            tensors.update({id(t): t for t in state.values() if isinstance(t, Tensor)})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--cases", type=int, nargs="*", default=None, help="indices of CASES to run (default all)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--flops", action="store_true", help="count each update's FLOPs instead of timing it")
    parser.add_argument("--peak", action="store_true", help="measure the device's matrix-product rate")
    parser.add_argument(
        "--no-cudnn-benchmark", action="store_true", help="cuDNN's heuristic algorithms (eblvm run's default)"
    )
    parser.add_argument("--profile", action="store_true", help="profile --steps eager steps of each case")
    parser.add_argument("--smoke", action="store_true", help="tiny networks, batch 4, 2 steps: a check, not a timing")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.smoke:
        global SMOKE
        SMOKE, args.steps, args.warmup = True, 2, 1
    if args.flops:
        return flops_table(device, args.cases, args.out)
    if args.peak:
        return peak_table(device, args.out, *((256, 2) if args.smoke else ()))
    # fixed shapes: let cuDNN time its convolution algorithms and keep the fastest ([run] cudnn_benchmark)
    torch.backends.cudnn.benchmark = not args.no_cudnn_benchmark
    if args.profile:
        return profile_table(device, args.steps, args.cases, args.out)
    card = device_name(device)
    lines = [
        f"Device: {card}; torch {torch.__version__}; {batch_label()}, 3×32×32 (MNIST 1×32×32); cuDNN autotuning "
        f"{'off' if args.no_cudnn_benchmark else 'on'}. Released code and target: measured and set"
        " on one H100 (torch 2.11); the ratio compares only on that card.",
        "",
        "| case | step | median step (ms) | p10-p90 (ms) | peak memory (GiB) | of which parameters, gradients, "
        "optimizer states (GiB) | released code, H100 (ms) | eblvm / released | released peak (GiB) "
        "| target, H100 (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        root = fake_cifar(Path(tmp))
        for i, (name, recipe, overrides) in enumerate(CASES):
            if args.cases is not None and i not in args.cases:
                continue
            for graphed in (False, True) if device.type == "cuda" else (False,):
                timed = time_case(recipe, overrides, root, device, args.steps, args.warmup, graphed)
                if timed is None:
                    continue
                times, peak, state = timed
                ms = sorted(1000 * t for t in times)
                deciles = statistics.quantiles(ms, n=10, method="exclusive" if len(ms) >= 10 else "inclusive")
                median = statistics.median(ms)
                lines.append(
                    f"| {name} | {'graph' if graphed else 'eager'} | {median:.1f} | {deciles[0]:.1f}-{deciles[-1]:.1f} "
                    f"| {peak / 2**30:.2f} | {state / 2**30:.2f} | {reference_columns(name, median, device.type == 'cuda')} |"
                )
                print(lines[-1], flush=True)
    write(lines, args.out)


def peak_table(device: torch.device, out: Path | None, size: int = 8192, repeats: int = 20) -> None:
    """TFLOP/s of a (size × size) @ (size × size) product on ``device``, the median of ``repeats``
    timed products after warm-up: fp32 with TF32 allowed and bf16 on CUDA, fp32 on a CPU."""
    if device.type != "cuda":
        size, repeats = min(size, 2048), min(repeats, 5)
    formats = [("fp32 (TF32 allowed)", torch.float32), ("bf16", torch.bfloat16)] if device.type == "cuda" else []
    formats = formats or [("fp32", torch.float32)]
    lines = [f"Measured matrix-product rate, {device_name(device)}, torch {torch.__version__}, {size} × {size}.", ""]
    lines += ["| format | median (ms) | TFLOP/s |", "|---|---|---|"]
    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        for name, dtype in formats:
            a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
            times = []
            for i in range(repeats + 3):
                synchronize(device)
                start = time.perf_counter()
                a @ b
                synchronize(device)
                if i >= 3:
                    times.append(time.perf_counter() - start)
            median = statistics.median(times)
            lines.append(f"| {name} | {1000 * median:.2f} | {2 * size**3 / median / 1e12:.3g} |")
            print(lines[-1], flush=True)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    write(lines, out)


def profile_case(recipe: str, overrides: list[str], root: Path, device: torch.device, steps: int) -> tuple[float, str]:
    """(wall seconds per step, the profiler's table of the top operators by self device time, or CPU
    time on a CPU) of ``steps`` eager steps of one case, after two warm-up steps."""
    from torch.profiler import ProfilerActivity, profile

    case = build_case(recipe, overrides, root, device)
    on_gpu = device.type == "cuda"

    def step() -> None:
        case.step()
        synchronize(device)

    for _ in range(2):
        step()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        wall = (time.perf_counter() - start) / steps
    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    return wall, prof.key_averages().table(sort_by=key, row_limit=15)


def profile_table(device: torch.device, steps: int, cases: list[int] | None, out: Path | None) -> None:
    """``profile_case`` of each case (or of the ``cases`` indices) as markdown sections."""
    lines = [f"Profiles of eager steps, {device_name(device)}, torch {torch.__version__}, {batch_label()}.", ""]
    with tempfile.TemporaryDirectory() as tmp:
        root = fake_cifar(Path(tmp))
        for i, (name, recipe, overrides) in enumerate(CASES):
            if cases is not None and i not in cases:
                continue
            wall, table = profile_case(recipe, overrides, root, device, steps)
            lines += [f"### {name}: {1000 * wall:.1f} ms per step under the profiler ({steps} steps)", "", "```"]
            lines += [table, "```", ""]
            print("\n".join(lines[-5:]), flush=True)
    write(lines, out)


def batch_label() -> str:
    return "batch 4 and tiny networks (--smoke: the numbers mean nothing)" if SMOKE else "batch 100"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write(lines: list[str], out: Path | None) -> None:
    print("\n".join(lines))
    if out:
        out.write_text("\n".join(lines) + "\n")


def flops_table(device: torch.device, cases: list[int] | None, out: Path | None) -> None:
    """One row per distinct update (the fp32 cases; precision and memory format do not change the count)."""
    lines = [
        f"FLOPs of one update, torch {torch.__version__} (flop_counter: matrix products and convolutions), "
        f"{batch_label()}.",
        "",
        "| case | GFLOP per update |",
        "|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        root = fake_cifar(Path(tmp))
        for i, (name, recipe, overrides) in enumerate(CASES):
            if "bf16" in name or "channels-first" in name or (cases is not None and i not in cases):
                continue
            lines.append(
                f"| {name.removesuffix(', fp32')} | {count_flops(recipe, overrides, root, device) / 1e9:.1f} |"
            )
            print(lines[-1], flush=True)
    write(lines, out)


if __name__ == "__main__":
    main()
