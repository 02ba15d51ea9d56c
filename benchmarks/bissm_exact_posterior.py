"""Why the bundled BiSSM falls under the scaled coupling (docs/results.md): three measurements. Not a timing.

    python benchmarks/bissm_exact_posterior.py gap RUN_DIR
    python benchmarks/bissm_exact_posterior.py path RUN_DIR [--checkpoint FILE] [--batches 200] [--blur 0.05]
    python benchmarks/bissm_exact_posterior.py train [--coupling scaled] [--unroll-steps 5] [--steps 30000] [--posterior exact]

``gap``: for each checkpoint a grbm_bissm run kept (``[run] keep_every``), the exact SM objective
J(θ) = mean[½‖∇log p‖² + tr ∇²log p] on the training set beside BiSSM's objective J(θ, φ) with the
run's trained q (the same objective on the modified score, averaged over 8 draws of the relaxed
h), their difference, the same difference with q put at the exact posterior (0: the modified score
is then the marginal score for every h), σ and the mean |logit|. The difference is what q's
departure from the posterior does to the objective the model descends.

``path``: at a BiSM GRBM run's checkpoint (SSM or DSM objective, its own recipe), with q put at the
exact posterior, the mean over batches of the hypergradient minus the exact-score gradient of the
same objective on the same points, for the run's N unrolled steps and for N = 0 (the partial
derivative at φ*): what the hypergradient misses of the path through φ*(θ), in all and in log σ;
``--blur`` adds Gaussian noise of that size to the training points first (smooth data).

``train``: grbm_bissm's own estimator step (K = 5 real posterior steps, N unrolled, one model
step) with ``--posterior exact`` putting q at the exact GRBM posterior in place of the K real steps: the objective is then exact SM and all that differs from exact-score SSM is the
hypergradient's truncated path through φ*(θ). Prints the exact test log-likelihood (50,000
points), the exact SM objective and σ every 2,500 steps.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch
from bissm_expected_update import bissm_parts, flat, set_exact_posterior
from eblvm_bism import modified_score
from eblvm_score.objectives import SM

from eblvm_core import api
from eblvm_core.build import build
from eblvm_core.contracts import exact_score
from eblvm_core.recipe import load_recipe

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "grbm_bissm.toml"


def exact_objective(model, x: torch.Tensor) -> float:
    """Exact SM objective mean[½‖s‖² + tr ∇s] of the model on x (n, d)."""
    return float(SM().loss(functools.partial(exact_score, model), x, None).mean().detach())


def modified_objective(model, posterior, x: torch.Tensor, draws: int = 8) -> float:
    """BiSSM's objective J(θ, φ): the SM objective on the modified score over x, averaged over draws of h."""
    torch.manual_seed(0)
    return (
        sum(float(SM().loss(modified_score(model, posterior), x, None).mean().detach()) for _ in range(draws)) / draws
    )


def gap(run_dir: Path) -> None:
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
    if not checkpoints:
        raise SystemExit(f"{run_dir}: no kept checkpoints (train with -o run.keep_every=N)")
    for checkpoint in checkpoints:
        parts, step, _ = bissm_parts(run_dir, checkpoint)
        model, x = parts.model, parts.data.tensor("train")
        exact = exact_objective(model, x)
        with_q = modified_objective(model, parts.posterior, x)
        set_exact_posterior(parts)
        with_exact_q = modified_objective(model, parts.posterior, x)
        with torch.no_grad():
            logits = model.hidden_logits(x)
        print(
            f"step {step:6d}  exact J(θ) {exact:8.2f}  J(θ, φ) with the trained q {with_q:8.2f}  "
            f"difference {with_q - exact:+7.2f} (with the exact q {with_exact_q - exact:+.2f})  "
            f"σ {float(model.sigma.detach()):.4f}  mean |logit| {float(logits.abs().mean()):.1f}",
            flush=True,
        )


def path(run_dir: Path, checkpoint: Path | None, batches: int, blur: float) -> None:
    run = api.load(run_dir, str(checkpoint) if checkpoint else "last", device="cpu")
    parts = run.parts
    set_exact_posterior(parts)
    estimator, model, x_all = parts.estimator, parts.model, parts.data.tensor("train")
    x_all = x_all + blur * torch.randn(x_all.shape, generator=torch.Generator().manual_seed(5))
    theta = [p for p in model.parameters() if p.requires_grad]
    print(f"{run_dir} step {run.step}: σ {float(model.sigma.detach()):.4f}, {type(estimator.objective).__name__}")
    for unroll_steps in (estimator.unroll_steps, 0):
        estimator.unroll_steps = unroll_steps
        generator = torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        exact_sum, difference_sum = 0.0, 0.0
        for _ in range(batches):
            x, context = estimator.objective.points(x_all[torch.randint(len(x_all), (100,), generator=generator)])
            loss = estimator.objective.loss(functools.partial(exact_score, model), x, context).mean()
            exact = flat(list(torch.autograd.grad(loss, theta)))
            exact_sum = exact_sum + exact
            difference_sum = difference_sum + flat(estimator.hypergradient(x, context)[0]).detach() - exact
        exact, bias = exact_sum / batches, difference_sum / batches  # log σ is the model's last parameter
        print(
            f"  N = {unroll_steps}: exact gradient norm {float(exact.norm()):.2f}, in log σ {float(exact[-1]):+.2f};  "
            f"mean hypergradient − exact: norm {float(bias.norm()):.2f}, in log σ {float(bias[-1]):+.2f}"
        )


def train(coupling: str, unroll_steps: int, steps: int, posterior: str) -> None:
    recipe = load_recipe(
        RECIPE, [f'model.coupling="{coupling}"', "data.n_test=50000", f"estimator.unroll_steps={unroll_steps}"]
    )
    torch.manual_seed(0)
    parts = build(recipe, torch.device("cpu")).parts
    estimator, model = parts.estimator, parts.model
    x_train, x_test = parts.data.tensor("train"), parts.data.tensor("test")
    generator = torch.Generator().manual_seed(0)
    if posterior == "exact":

        def exact_fit(*_inputs) -> dict[str, float]:
            """In place of the step's K real posterior updates: q := the exact posterior."""
            set_exact_posterior(parts)
            return {}

        estimator.fit_posterior = exact_fit
    for step in range(1, steps + 1):
        estimator.step(x_train[torch.randint(len(x_train), (100,), generator=generator)])
        if step % 2500 == 0:
            with torch.no_grad():
                loglik = float(model.log_likelihood(x_test).mean())
            print(
                f"{coupling}, q {posterior}, N = {unroll_steps}, step {step:6d}: test log-likelihood {loglik:+.4f}  "
                f"exact J(θ) {exact_objective(model, x_train[:20000]):7.2f}  σ {float(model.sigma.detach()):.4f}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("gap").add_argument("run", type=Path)
    at_checkpoint = commands.add_parser("path")
    at_checkpoint.add_argument("run", type=Path)
    at_checkpoint.add_argument("--checkpoint", type=Path, default=None, help="default: the run's last")
    at_checkpoint.add_argument("--batches", type=int, default=200)
    at_checkpoint.add_argument("--blur", type=float, default=0.0, help="noise added to the training points")
    training = commands.add_parser("train")
    training.add_argument("--coupling", choices=["scaled", "plain"], default="scaled")
    training.add_argument("--unroll-steps", type=int, default=5)
    training.add_argument("--steps", type=int, default=30000)
    training.add_argument("--posterior", choices=["exact", "trained"], default="exact")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.command == "gap":
        gap(args.run)
    elif args.command == "path":
        path(args.run, args.checkpoint, args.batches, args.blur)
    else:
        train(args.coupling, args.unroll_steps, args.steps, args.posterior)


if __name__ == "__main__":
    main()
