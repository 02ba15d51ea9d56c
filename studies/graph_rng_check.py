"""Where a CUDA graph's random draws part from the eager ones, after what the process did before.

    python studies/graph_rng_check.py           # a CUDA device; about 10 s
    python studies/graph_rng_check.py --fresh   # each variant below in a fresh process; about 30 s

On an H100 (torch 2.11) three tests of tests/e2e/test_cuda.py failed only after other CUDA graphs had
been captured in the same process: a new ``GraphedStep``'s draws left those of the eager run of
the same seed from the capturing step on (docs/benchmarks.md). This script repeats the smallest
of them (a step drawing ``randn(3)``, fused Adam) in one process after each of these, in order:
nothing; a live graph of another step; that graph deleted; ``torch.cuda.set_rng_state`` (what a
resumed run does); a recipe-sized graph (BiDSM on the GRBM through ``eblvm run``). For each it
prints whether the draws agree, the first step where they part, and the default CUDA generator's
Philox offset after every call of the eager and the replayed runs.

On an H200 (torch 2.11) the test itself then failed when run alone in a fresh pytest process and
passed after any test that had used a side stream. ``--fresh`` runs the comparison first thing
in a fresh process, in four variants, and prints for each parted call which eager draw the
graph's equals and how many of the graph's draws are distinct: as is; after a side stream has
run one kernel; with a device synchronisation before every replay (if a copy or fill of the
generator's seed and offset on another stream raced the first replay, this agrees); with both.
"""

from __future__ import annotations

import argparse
import gc
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from eblvm_core.graphs import GraphedStep
from eblvm_core.roles import TrainingRole

CUDA = torch.device("cuda")
STEPS = 10


def small_step(size: int = 3):
    """The failing test's step (size 3): (parameters, role, step(batch) -> metrics with its noise)."""
    p = torch.zeros(size, device=CUDA, requires_grad=True)
    role = TrainingRole("model", torch.optim.Adam([p], lr=0.1, fused=True))

    def step(batch: torch.Tensor) -> dict[str, torch.Tensor]:
        noise = torch.randn(size, device=CUDA)
        loss = ((p - batch - noise) ** 2).sum()
        role.update(loss)
        return {"loss": loss.detach(), "noise": noise.clone()}

    return p, role, step


def offset() -> int:
    torch.cuda.synchronize()
    return int(torch.cuda.default_generators[0].get_offset())


def compare(label: str) -> None:
    """Eager and graph-replayed runs of ``small_step`` from seed 0: draws and generator offsets."""
    batches = [torch.full((3,), float(i), device=CUDA) for i in range(STEPS)]
    torch.manual_seed(0)
    _, _, eager = small_step()
    eager_noise, eager_offsets = [], []
    for b in batches:
        eager_noise.append(eager(b)["noise"].clone())
        eager_offsets.append(offset())
    torch.manual_seed(0)
    _, role, step = small_step()
    graphed = GraphedStep(step, {"model": role}, print)
    graph_noise, graph_offsets = [], []
    for b in batches:
        graph_noise.append(graphed(b)["noise"].clone())
        graph_offsets.append(offset())
    parted = [i for i, (a, b) in enumerate(zip(eager_noise, graph_noise)) if not torch.equal(a, b)]
    verdict = "agree" if not parted else f"part from call {parted[0]} (0-based; captured at call 3)"
    print(f"{label}: draws {verdict}; graph captured: {graphed.graph is not None}")
    print(f"  eager offsets: {eager_offsets}\n  graph offsets: {graph_offsets}")
    if parted:
        i = parted[0]
        print(f"  call {i}: eager {eager_noise[i].tolist()}\n  call {i}: graph {graph_noise[i].tolist()}")
        for i in parted:
            same = [j for j, n in enumerate(eager_noise) if torch.equal(n, graph_noise[i])]
            print(f"  the graph's draw at call {i} equals the eager draw of calls {same}")
        distinct = len({tuple(n.tolist()) for n in graph_noise})
        print(f"  distinct graph draws: {distinct} of {len(graph_noise)}")


def other_graph() -> GraphedStep:
    """A graph of another step (``small_step`` of size 1,000), captured and replayed a few times."""
    _, role, step = small_step(1000)
    graphed = GraphedStep(step, {"model": role}, print)
    for _ in range(8):
        graphed(torch.zeros(1000, device=CUDA))
    return graphed


def main() -> None:
    print(torch.__version__, torch.cuda.get_device_name())
    compare("1. first in the process")
    kept = other_graph()
    compare("2. with another graph alive")
    del kept
    gc.collect()
    compare("3. after that graph was deleted")
    torch.cuda.set_rng_state(torch.cuda.get_rng_state())
    compare("4. after torch.cuda.set_rng_state")
    from eblvm_core.session import run

    with tempfile.TemporaryDirectory() as tmp:
        recipe = Path(__file__).resolve().parents[1] / "recipes" / "grbm_bidsm.toml"
        run(recipe, ["run.steps=20", "run.eval_every=0", "~eval"], device="cuda", out=tmp, echo=lambda _: None)
    gc.collect()
    compare("5. after a recipe trained through eblvm run (its graph gone)")


VARIANTS = ("as-is", "side-stream-first", "sync-before-replay", "side-stream-first+sync-before-replay")


def fresh(variant: str) -> None:
    """The comparison first thing in this process, under ``variant`` (one of VARIANTS)."""
    if "side-stream-first" in variant:
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.zeros(1, device=CUDA).add_(1)
        torch.cuda.synchronize()
    if "sync-before-replay" in variant:
        replay = torch.cuda.CUDAGraph.replay

        def synchronized_replay(self) -> None:
            torch.cuda.synchronize()
            replay(self)

        torch.cuda.CUDAGraph.replay = synchronized_replay
    compare(f"fresh process, {variant}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fresh", action="store_true", help="each variant in a fresh process")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        fresh(args.variant)
    elif args.fresh:
        for variant in VARIANTS:
            subprocess.run([sys.executable, __file__, "--variant", variant], check=False)
    else:
        main()
