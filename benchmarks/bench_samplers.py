"""Each sampler on a trained checkerboard GRBM: the total variation distance of its samples to the
model's exact density on a grid, and its effective sample size per second on one CPU thread.

    eblvm run recipes/grbm_bissm.toml && python benchmarks/bench_samplers.py runs/grbm_bissm [--out table.md]
    python benchmarks/bench_samplers.py RUN_DIR [--chains 100] [--warmup 500] [--draws 400] [--rounds 3]
    python benchmarks/bench_samplers.py RUN_DIR --smoke     # tiny sizes, in seconds: a check, not a measurement

Every sampler runs ``--chains`` chains (tempering: ladders of 8 replicas), ``--warmup``
transitions (Gibbs: burn-in sweeps; MALA and HMC adapt their step sizes meanwhile), then keeps
``--draws`` states of each chain, one per transition. The distance is ½ Σ |p̂ − p| over a 20 × 20
grid of cells of side 0.1 covering [−0.5, 1.5]², p each cell's exact probability under the GRBM
(a Gaussian mixture over the 2^m hidden states, integrated by its CDFs), the mass outside the grid
one more cell; the row "exact draws" is the same number of independent draws of the model: the
floor that sampling noise sets. ESS is the smaller of the sampler's own reports on the free
energy and on three fixed projections of v (the split-chain estimator of eblvm.tools), R-hat the
larger; ESS/s divides it by the wall time of the whole draw, warm-up included, the median over
``--rounds`` seeded repeats (samples, distance and ESS are the first round's).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from eblvm_grbm.model import GRBM, all_binary

import eblvm
from eblvm_core.config import structure
from eblvm_core.plugins import load as load_plugins

EDGES = torch.linspace(-0.5, 1.5, 21, dtype=torch.float64)


def cases(chains: int, warmup: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, sampler, options): each sampler at its default kernel settings, the sizes shared."""
    shared = {"n_chains": chains, "warmup": warmup}
    return [
        ("Gibbs", "gibbs", {"n_chains": chains, "burn_in": warmup}),
        ("MALA", "mala", shared),
        ("HMC (L = 10)", "hmc", shared),
        ("tempering, Gibbs moves (8 β to 0.1)", "tempering", {**shared, "moves": "gibbs"}),
        ("tempering, MALA moves (8 β to 0.1)", "tempering", {**shared, "moves": "mala"}),
    ]


def mixture(model: GRBM) -> tuple[torch.Tensor, torch.Tensor, float]:
    """p(v) as a Gaussian mixture: the weights (2^m,) of the hidden states, the means b + σ²Uh (2^m, d), σ."""
    with torch.no_grad():
        hs = all_binary(model.latent.dim, model.W).double()
        u, b, c = model.coupling_weight().double(), model.b.double(), model.c.double()
        sigma = float(model.sigma)
        uh = hs @ u.T
        weights = torch.softmax(hs @ c + uh @ b + 0.5 * sigma**2 * (uh**2).sum(-1), 0)
        return weights, b + sigma**2 * uh, sigma


def cell_masses(model: GRBM) -> torch.Tensor:
    """Each grid cell's exact probability (400,)."""
    weights, means, sigma = mixture(model)
    cdf = 0.5 * (1 + torch.erf((EDGES[None, None, :] - means[:, :, None]) / (sigma * math.sqrt(2))))
    per_axis = cdf[..., 1:] - cdf[..., :-1]
    return (weights[:, None, None] * per_axis[:, 0, :, None] * per_axis[:, 1, None, :]).sum(0).flatten()


def total_variation(samples: torch.Tensor, exact: torch.Tensor) -> float:
    """½ Σ |p̂ − p| over the cells and the mass outside them: samples (n, 2)."""
    counts = torch.histogramdd(samples.double(), bins=[EDGES, EDGES]).hist.flatten() / len(samples)
    return 0.5 * float((counts - exact).abs().sum() + abs(counts.sum() - exact.sum()))


def exact_draws(model: GRBM, n: int) -> torch.Tensor:
    """n independent draws (n, 2) of the GRBM: h from the mixture's weights, then v ~ N(b + σ²Uh, σ²I)."""
    g = torch.Generator().manual_seed(0)
    weights, means, sigma = mixture(model)
    index = torch.multinomial(weights, n, replacement=True, generator=g)
    return means[index] + sigma * torch.randn(n, means.shape[1], generator=g, dtype=means.dtype)


def build_sampler(name: str, options: dict[str, Any], parts: Any) -> Any:
    entry = load_plugins()["samplers"].get(name)
    return entry.factory(structure(entry.config, options, "sampler"), parts)


def measure(sampler: Any, model: GRBM, n: int, rounds: int) -> tuple[torch.Tensor, dict[str, float], float]:
    """(samples, diagnostics) of the first of ``rounds`` draws seeded 0, 1, ..., and the median wall time."""
    times, first = [], None
    for seed in range(rounds):
        start = time.perf_counter()
        drawn = sampler.draw(model, n, torch.Generator().manual_seed(seed))
        times.append(time.perf_counter() - start)
        first = first or drawn
    return first.samples, first.diagnostics, statistics.median(times)


def row(label: str, distance: float, diagnostics: dict[str, float] | None, seconds: float | None) -> str:
    if diagnostics is None:
        return f"| {label} | {distance:.3f} | | | | |"
    ess = min(diagnostics["ess_energy"], diagnostics["ess_projections"])
    rhat = max(diagnostics["rhat_energy"], diagnostics["rhat_projections"])
    return f"| {label} | {distance:.3f} | {ess:,.0f} | {rhat:.3f} | {seconds:.3g} | {ess / seconds:,.0f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a run directory of a GRBM on 2-D data (grbm_bissm)")
    parser.add_argument("--chains", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--draws", type=int, default=400, help="kept states per chain, one per transition")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="10 chains, 20 warm-up transitions, 8 draws, 1 round")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    args = parser.parse_args()
    if args.smoke:
        args.chains, args.warmup, args.draws, args.rounds = 10, 20, 8, 1
    run = eblvm.load(args.run, device="cpu", echo=None)
    torch.set_num_threads(1)
    model, n = run.model, args.chains * args.draws
    exact = cell_masses(model)
    lines = [
        f"{run.recipe.run.name} at step {run.step}: {n:,} samples ({args.chains} chains × {args.draws}), "
        f"{args.warmup} warm-up transitions, one CPU thread, median of {args.rounds}",
        "",
        "| sampler | TV to the exact density | ESS | R-hat | seconds | ESS/s |",
        "|---|---|---|---|---|---|",
        row("exact draws", total_variation(exact_draws(model, n), exact), None, None),
    ]
    for label, name, options in cases(args.chains, args.warmup):
        samples, diagnostics, seconds = measure(build_sampler(name, options, run.parts), model, n, args.rounds)
        lines.append(row(label, total_variation(samples.flatten(1), exact), diagnostics, seconds))
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
