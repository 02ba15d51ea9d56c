"""eblvm's BiDSM step against a hand-written step of the same math, interleaved in one process.

    python benchmarks/bench_overhead.py [--rounds 20] [--block 10] [--trainer-block 20] [--frey] [--clock cpu]
    python benchmarks/bench_overhead.py --profile     # the ATen operations of one step of each, counted
    python benchmarks/bench_overhead.py --smoke       # two rounds of one step, in seconds: a check, not a timing

The hand-written step (``HandStep``) is plain torch: no eblvm code runs inside it. It does what
``recipes/grbm_bidsm.toml`` with ``estimator.unroll="sgd"`` does: the GRBM energy with the plain
coupling, E(v, h) = ‖v − b‖²/(2σ²) − cᵀh − vᵀWh; the linear Bernoulli posterior relaxed by
binary concrete at T = 0.1 (h = sigmoid((l + logit u)/T), log q = Σ h·l − softplus(l)); the KL
lower level E_q[log q + E] with one sample; K = 5 real Adam steps of φ; N = 5 differentiable SGD
steps φ − α·∂G/∂φ (α = 1.0); DSM (σ = 0.05) on the modified score ŝ(x) = ∇_x[−E(x, h) − log q(h|x)]
at the noisy points x = v + σε (h drawn at x held fixed, at φ_N); then one Adam step of θ. The
random draws come in eblvm's order (ε, then one uniform draw per lower-level evaluation, then the
upper level's), so from the same parameters, optimizer states and seed both steps give the same
parameters. The script checks that first and stops when, after one step, the parameters or the
gradients the updates used differ by more than 1e-6 (relative); it prints the differences over
three steps and whether the parameters are bit-identical.

Then the cases take turns (as in bench_estimators.py): every round runs ``--block`` timed steps
of (a) the hand-written step, (b) ``estimator.step(batch)`` of the built recipe, and (c) the real training
loop, ``Trainer.fit`` over ``--trainer-block`` steps (batch stream, step, NaN-guard and metric
bookkeeping, one log line per block; no evaluators, no checkpoint), divided by the steps.
Reported: the median step and the 10th-90th percentiles of the round medians, and the ratios of
the medians to the hand-written step. ``--frey`` adds the Frey-face size (v = 560, h = 400, a
random stand-in of the real file). ``--profile`` prints, instead, the ATen operations of one
step of each (counts per operator), to see what eblvm adds.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import scipy.io
import torch
import torch.nn.functional as F
from torch import Tensor

from eblvm_core.build import build
from eblvm_core.checkpoint import seed_everything
from eblvm_core.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
CLOCK = time.perf_counter  # --clock cpu: time.thread_time, the CPU time of this thread alone
SGD = ['estimator.unroll="sgd"', "run.log_every=1000000", "run.checkpoint_every=1000000", "run.eval_every=0"]


class HandStep:
    """One BiDSM training step (K real, N unrolled SGD lower-level steps) in plain torch.

    θ = (W (d, m), b (d,), c (m,), log σ) and φ = (A (m, d), a (m,)), the posterior's logits
    being l(x) = A x + a; two fused Adams as the recipe's. ``__call__(v)`` takes a batch (B, ...), seen as (B, d).
    """

    def __init__(self, theta: list[Tensor], phi: list[Tensor], model_opt: dict, post_opt: dict, hyper: dict):
        self.theta = [t.detach().clone().requires_grad_(True) for t in theta]
        self.phi = [t.detach().clone().requires_grad_(True) for t in phi]
        self.opt_theta = torch.optim.Adam(self.theta, **model_opt, fused=True)
        self.opt_phi = torch.optim.Adam(self.phi, **post_opt, fused=True)
        self.sigma, self.temperature = hyper["sigma"], hyper["temperature"]
        self.k, self.n, self.alpha = hyper["inner_steps"], hyper["unroll_steps"], hyper["inner_lr"]

    def relaxed(self, logits: Tensor) -> Tensor:
        """A binary-concrete sample (1, B, m) at the logits (B, m)."""
        u = torch.rand((1, *logits.shape), dtype=logits.dtype)
        return torch.sigmoid((logits + torch.logit(u, eps=1e-6)) / self.temperature)

    def energy(self, x: Tensor, h: Tensor) -> Tensor:
        """E(x, h): (B, d), (B, m) -> (B,)."""
        w, b, c, log_sigma = self.theta
        return 0.5 * ((x - b) ** 2).sum(-1) * torch.exp(-2 * log_sigma) - (h * (c + x @ w)).sum(-1)

    def kl(self, x: Tensor, phi: list[Tensor]) -> Tensor:
        """G = mean E_q[log q(h|x) + E(x, h)], one relaxed sample per point."""
        logits = F.linear(x, *phi)
        h = self.relaxed(logits)
        log_q = (h * logits - F.softplus(logits)).sum(-1)
        return (log_q + self.energy(x, h.reshape(len(x), -1)).view(1, -1)).view(-1).mean()

    def __call__(self, v: Tensor) -> dict[str, Tensor]:
        v = v.flatten(1)  # Frey faces come as (B, 28, 20)
        eps = torch.randn_like(v)
        x = v + self.sigma * eps
        for _ in range(self.k):  # K real posterior updates, θ frozen
            lower = self.kl(x, self.phi)
            for p, g in zip(self.phi, torch.autograd.grad(lower, self.phi)):
                p.grad = g
            self.opt_phi.step()
        phi = self.phi
        for n in range(self.n):  # N differentiable SGD steps: φ_N(θ)
            lower = self.kl(x, phi)
            if n == 0:
                lower_at_start = lower.detach()
            grads = torch.autograd.grad(lower, phi, create_graph=True)
            phi = [torch.add(p, g, alpha=-self.alpha) for p, g in zip(phi, grads)]
        h = self.relaxed(F.linear(x, *phi))[0]  # drawn at x held fixed
        xg = x.detach().requires_grad_(True)
        logits = F.linear(xg, *phi)
        total = self.energy(xg, h) + (h * logits - F.softplus(logits)).sum(-1)
        (grad_x,) = torch.autograd.grad(total.sum(), xg, create_graph=True)
        upper = (0.5 * ((-grad_x + eps / self.sigma) ** 2).sum(1)).mean()  # DSM on ŝ = −∇_x(E + log q)
        for p, g in zip(self.theta, torch.autograd.grad(upper, self.theta)):
            p.grad = g
        self.opt_theta.step()
        return {"loss": upper.detach(), "lower_loss": lower_at_start}


def adam_options(opt: torch.optim.Optimizer) -> dict[str, Any]:
    group = opt.param_groups[0]
    return {k: group[k] for k in ("lr", "betas", "eps", "weight_decay")}


def built_case(recipe: Path, overrides: list[str]):
    """The recipe built from seed 0, with a batch of its training data and its Recipe."""
    spec = load_recipe(recipe, overrides)
    seed_everything(0)
    built = build(spec, torch.device("cpu"))
    batch = built.parts.data.tensor("train", spec.run.batch_size)
    return spec, built, batch


def hand_from(built: Any, spec: Any) -> HandStep:
    """A HandStep with the built estimator's current parameters and hyper-parameters."""
    est = built.parts.estimator
    model, posterior = est.model, est.posterior
    assert model.coupling == "plain" and len(posterior.net) == 1, "the hand-written step is the plain, linear case"
    theta = [model.W, model.b, model.c, model.log_sigma]
    assert [id(t) for t in theta] == [id(t) for t in est.theta]
    phi = [posterior.net[0].weight, posterior.net[0].bias]
    hyper = {
        "sigma": est.objective.sigma,
        "temperature": posterior.temperature,
        "inner_steps": est.inner_steps,
        "unroll_steps": est.unroll_steps,
        "inner_lr": est.inner_lr,
    }
    assert est.unroll == "sgd"
    return HandStep(
        theta, phi, adam_options(est.model_role.optimizer), adam_options(est.posterior_role.optimizer), hyper
    )


def relative(a: Tensor, b: Tensor) -> float:
    """max |a − b| / max |b|."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def check_same_math(recipe: Path, overrides: list[str], steps: int = 3) -> float:
    """Run ``steps`` steps of eblvm and of the hand-written step from the same state and seed;
    print after each the largest relative differences of the parameters, of the gradients the
    last updates used (θ's hypergradient, φ's K-th lower-level gradient: Adam's first steps move
    every parameter by about lr whatever its gradient, so the parameters alone would hide a
    wrong gradient) and of the loss. Returns the largest parameter or gradient difference after
    the first step: later steps are shown only, as Adam turns a rounding difference in a gradient
    entry near 0 (c starts at 0) into a step of the opposite sign, so two roundings of the same
    math drift apart there."""
    spec, built, batch = built_case(recipe, overrides)
    est = built.parts.estimator
    hand = hand_from(built, spec)
    ours = est.theta + list(est.phi.values())
    worst = 0.0
    for i in range(steps):
        torch.manual_seed(1000 + i)
        m_ours = est.step(batch)
        torch.manual_seed(1000 + i)
        m_hand = hand(batch)
        params = [relative(a.detach(), b.detach()) for a, b in zip(ours, hand.theta + hand.phi)]
        grads = [relative(a.grad, b.grad) for a, b in zip(ours, hand.theta + hand.phi)]
        loss = abs(float(m_ours["loss"]) - float(m_hand["loss"])) / abs(float(m_hand["loss"]))
        if i == 0:
            worst = max(*params, *grads)
        same = all(torch.equal(a, b) for a, b in zip(ours, hand.theta + hand.phi))
        print(
            f"  step {i + 1}: max relative difference: parameters {max(params):.2e}, gradients {max(grads):.2e}, "
            f"loss {loss:.2e} (parameters bit-identical: {same})"
        )
    return worst


@attrs.define
class Case:
    name: str
    run: Callable[[], list[float]]  # runs one block, returns its per-step times (s)
    times: list[float] = attrs.field(factory=list)  # per-step times of every block
    round_medians: list[float] = attrs.field(factory=list)


def step_case(name: str, step: Callable[[Tensor], Any], batch: Tensor, block: int) -> Case:
    def run() -> list[float]:
        times = []
        for _ in range(block):
            start = CLOCK()
            step(batch)
            times.append(CLOCK() - start)
        return times

    return Case(name, run)


def trainer_case(name: str, spec: Any, built: Any, folder: Path, block: int) -> Case:
    """``Trainer.fit`` over ``block`` more steps per call (a trainer per call, on one run state, of a
    recipe built without evaluators); checkpoints skipped."""
    from eblvm_core.records import Records
    from eblvm_core.state import RunState
    from eblvm_core.trainer import Trainer

    state = RunState(spec, built)
    state.save = lambda *args, **kwargs: None  # type: ignore[method-assign]
    records = Records(folder)

    def run() -> list[float]:
        recipe = attrs.evolve(spec, run=attrs.evolve(spec.run, steps=state.step + block))
        start = CLOCK()
        with contextlib.redirect_stderr(io.StringIO()):  # no progress bar
            Trainer(recipe, state, records).fit()
        return [(CLOCK() - start) / block]

    return Case(name, run)


def time_interleaved(cases: list[Case], rounds: int, warmup: int) -> None:
    for case in cases:
        for _ in range(warmup):
            case.run()
    for _ in range(rounds):
        for case in cases:
            times = case.run()
            case.times += times
            case.round_medians.append(statistics.median(times))


def summary(case: Case) -> tuple[float, float, float]:
    """(median step, 10th and 90th percentile of the round medians), in ms."""
    q = statistics.quantiles(case.round_medians, n=10, method="inclusive")
    return 1000 * statistics.median(case.times), 1000 * q[0], 1000 * q[-1]


def profile_ops(step: Callable[[], Any], repeat: int = 3) -> Counter:
    """ATen operations (name -> count) of one step, from the profiler, after ``repeat`` warm-up calls."""
    for _ in range(repeat):
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    return Counter({e.key: e.count for e in prof.key_averages()})


def frey_stand_in(folder: Path) -> Path:
    rng = np.random.default_rng(0)
    scipy.io.savemat(folder / "frey_rawface.mat", {"ff": rng.integers(0, 256, (560, 1965), dtype=np.uint8)})
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--block", type=int, default=10, help="timed steps per round at checkerboard size")
    parser.add_argument("--trainer-block", type=int, default=20, help="steps of one Trainer.fit call")
    parser.add_argument("--frey", action="store_true", help="also the Frey-face size (slow)")
    parser.add_argument("--frey-block", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall: time.perf_counter; cpu: this thread's CPU time (time.thread_time), blind to waiting for a core",
    )
    parser.add_argument("--no-trainer", action="store_true", help="skip the training-loop case")
    parser.add_argument("--profile", action="store_true", help="count the ATen operations of one step instead")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each case first")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="two rounds of one step (the loop: two steps), no warm-up, checkerboard only",
    )
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.block, args.trainer_block, args.warmup, args.frey = 2, 1, 2, 0, False
    global CLOCK
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        sizes = [("checkerboard", ROOT / "recipes" / "grbm_bidsm.toml", SGD, args.block)]
        if args.frey:
            root = frey_stand_in(Path(tmp))
            frey = SGD + [f'data.root="{root}"', "run.threads=0"]
            sizes.append(("Frey size", ROOT / "recipes" / "freyface_bidsm.toml", frey, args.frey_block))
        print(
            f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread"
        )
        cases: list[tuple[str, Case]] = []
        for size, recipe, overrides, block in sizes:
            print(f"{size}: eblvm against the hand-written step, 3 steps from the same state and seed")
            worst = check_same_math(recipe, overrides)
            if worst > 1e-6:
                sys.exit(f"{size}: the hand-written step is not the same math (relative difference {worst:.2e} > 1e-6)")
            spec, built, batch = built_case(recipe, overrides)
            torch.set_num_threads(args.threads)  # build sets the recipe's threads
            hand = hand_from(built, spec)
            if args.profile:
                for name, step in (("hand-written", hand), ("estimator.step", built.parts.estimator.step)):
                    ops = profile_ops(lambda step=step, batch=batch: step(batch))
                    aten = {k: v for k, v in ops.items() if k.startswith("aten::")}
                    print(f"{size} {name}: {sum(aten.values())} aten ops (all levels)")
                    for key, count in sorted(aten.items(), key=lambda kv: -kv[1])[:40]:
                        print(f"    {count:5d} {key}")
                continue
            cases.append((size, step_case("hand-written", hand, batch, block)))
            cases.append((size, step_case("estimator.step", built.parts.estimator.step, batch, block)))
            if not args.no_trainer and size == "checkerboard":
                spec_t, built_t, _ = built_case(recipe, [*overrides, "~eval"])  # the loop alone: no evaluation
                torch.set_num_threads(args.threads)
                folder = Path(tmp) / f"run-{size}"
                folder.mkdir()
                cases.append((size, trainer_case("Trainer.fit, per step", spec_t, built_t, folder, args.trainer_block)))
        if args.profile:
            return
        time_interleaved([c for _, c in cases], args.rounds, args.warmup)
        base: dict[str, float] = {}
        print(f"\n{args.rounds} interleaved rounds; median step (10th-90th percentile of the round medians)")
        print("| size | step | ms | ratio to hand-written |")
        print("|---|---|---|---|")
        for size, case in cases:
            median, low, high = summary(case)
            base.setdefault(size, median)
            print(f"| {size} | {case.name} | {median:.2f} ({low:.2f}-{high:.2f}) | {median / base[size]:.3f} |")


if __name__ == "__main__":
    main()
