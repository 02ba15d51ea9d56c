"""Why the bundled BiSSM falls under the scaled coupling (docs/results.md): four measurements. Not a timing.

    python studies/bissm_exact_posterior.py gap RUN_DIR
    python studies/bissm_exact_posterior.py path RUN_DIR [--checkpoint FILE] [--batches 200] [--blur 0.05 | --model-data] [--exact-kl]
    python studies/bissm_exact_posterior.py split RUN_DIR [--checkpoint FILE] [--blur 0.05] [--points 600000] [--seed 1]
    python studies/bissm_exact_posterior.py train [--coupling scaled] [--unroll-steps 5] [--steps 30000] [--posterior exact] [--add-trace-term]

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
``--blur`` adds Gaussian noise of that size to the training points first (smooth data);
``--model-data`` replaces them by as many exact draws from the model (no score error);
``--exact-kl`` unrolls on the KL in closed form instead of the run's sampled one. For an
SM or SSM run, N = 0's miss is split into SM's trace term through q (closed form) and the rest.

``split``: at a BiSSM checkpoint, q at the exact posterior, BiSSM's ∂J/∂φ by autograd (exact-trace SM,
fresh points of the checkerboard blurred by ``--blur``, whose score is known in closed form) against
D + R: D the trace term through q (closed form) and R = E[(∇log p_θ − ∇log p_data)ᵀ E_h ∂_φŝ], the
score-error term. Integration by parts makes them equal in expectation.

``train``: grbm_bissm's own estimator step (K = 5 real posterior steps, N unrolled, one model
step) with ``--posterior exact`` putting q at the exact GRBM posterior in place of the K real steps: the objective is then exact SM and all that differs from exact-score SSM is the
hypergradient's truncated path through φ*(θ). ``--add-trace-term`` (with ``--unroll-steps 0``)
adds to the partial derivative the trace term's part of that path in closed form. Prints the exact
test log-likelihood (50,000 points), the exact SM objective and σ every 2,500 steps.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch
from bissm_expected_update import bissm_parts, flat, set_exact_posterior
from eblvm_bism import modified_score
from eblvm_grbm.model import all_binary
from eblvm_score.objectives import SM, SSM
from eblvm_toy import checkerboard_sample

from eblvm import api
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


def trace_term_miss(model, posterior, x: torch.Tensor, theta: list[torch.Tensor]) -> torch.Tensor:
    """The part of the N = 0 miss that SM's trace term makes without the data's score (flat, θ's order).

    Integrating the trace term by parts, J_SM(θ, φ) = ½E‖ŝ − ∇log p_data‖² − E[ŝᵀ∇_v log r(h|v)] + const,
    r the density h is drawn from. At φ* the modified score ŝ equals the marginal score for every h,
    so ∂J/∂φ = (a term linear in the model's score error) + D, with, for linear Bernoulli logits
    l = Av + c', D_A = diag(E_x[m′(l_j)]) A and D_c' = 0, m(l) = E[h_j] under the relaxed draw.
    What N = 0 misses of the path through φ*(θ) is −(∂J/∂φ)·dφ*/dθ; this returns −D·dφ*/dθ, with
    dφ*/dθ by autograd through U(θ) = Aᵀ*: in log σ it is +Σ_j E[m′_j]‖U_j‖² under the scaled
    coupling and 0 under the plain one. DSM's objective has no trace term, so no D.
    """
    slope = relaxed_slope(posterior, x)
    coupling = model.coupling_weight()  # U = A*ᵀ (d, m), a function of θ
    return -flat(list(torch.autograd.grad((coupling.detach() * slope * coupling).sum(), theta, materialize_grads=True)))


def relaxed_slope(posterior, x: torch.Tensor) -> torch.Tensor:
    """E_x[m′(l_j(x))] (m,): m(l) = E[h_j] under the binary-concrete draw, by quadrature over its uniform."""
    u = (torch.arange(1000, dtype=x.dtype) + 0.5) / 1000
    total = 0.0
    with torch.no_grad():
        for chunk in posterior.logits(x).split(10000):  # (≤ 10,000, m)
            h = torch.sigmoid((chunk.unsqueeze(-1) + torch.logit(u)) / posterior.temperature)
            total = total + (h * (1 - h)).mean(-1).sum(0)
    return total / len(x) / posterior.temperature


def blurred_checkerboard_log_density(x: torch.Tensor, n_cols: int, blur: float) -> torch.Tensor:
    """log of the checkerboard's density convolved with N(0, blur² I): x (n, 2) -> (n,)."""
    normal = torch.distributions.Normal(0.0, blur)
    width = 1 / n_cols
    density = 0.0
    for i in range(n_cols):
        for j in range(n_cols):
            if (i + j) % 2 == 0:
                corner = torch.tensor([i, j], dtype=x.dtype) * width
                density = density + torch.prod(normal.cdf(x - corner) - normal.cdf(x - corner - width), -1)
    return torch.log(density / (width**2 * ((n_cols**2 + 1) // 2)))


def load_at_exact_posterior(run_dir: Path, checkpoint: Path | None):
    """The run at its checkpoint (default: the last) on the CPU, with q put at the exact GRBM posterior."""
    run = api.load(run_dir, str(checkpoint) if checkpoint else "last", device="cpu")
    set_exact_posterior(run.parts)
    return run


def split(run_dir: Path, checkpoint: Path | None, blur: float, points: int, seed: int) -> None:
    """∂J/∂φ at φ* by autograd against D + R, on fresh points of the blurred checkerboard (known score)."""
    run = load_at_exact_posterior(run_dir, checkpoint)
    model, posterior = run.parts.model.double(), run.parts.posterior.double()
    n_cols = run.recipe.parts["data"].config.n_cols
    x = checkerboard_sample(points, n_cols, torch.Generator().manual_seed(seed)).double()
    x = x + blur * torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=x.dtype)
    phi = [posterior.net[0].weight, posterior.net[0].bias]  # A (m, d), c' (m,)
    draws = 4
    torch.manual_seed(0)
    autograd = sum(
        flat(list(torch.autograd.grad(SM().loss(modified_score(model, posterior), x, None).mean(), phi)))
        for _ in range(draws)
    )
    trace_term = flat([relaxed_slope(posterior, x)[:, None] * phi[0].detach(), torch.zeros_like(phi[1])])
    leaf = x.clone().requires_grad_(True)
    data_score = torch.autograd.grad(blurred_checkerboard_log_density(leaf, n_cols, blur).sum(), leaf)[0]
    score_error = exact_score(model, x).detach() - data_score  # (n, d)
    residual = 0.0
    for _ in range(draws):  # ∂_φ ŝ weighted by the score error (the path through the reparameterised h is 0 at φ*)
        modified = modified_score(model, posterior)(x)
        residual = residual + flat(list(torch.autograd.grad((score_error * modified).sum() / len(x), phi)))
    autograd, residual = autograd / draws, residual / draws
    print(f"{run_dir} step {run.step}: {points} points of the checkerboard blurred by {blur}, q at the exact posterior")
    for name, vector in (
        ("∂J/∂φ by autograd", autograd),
        ("D (trace term through q)", trace_term),
        ("R (score error)", residual),
        ("D + R", trace_term + residual),
    ):
        print(f"  {name:26s} norm {float(vector.norm()):8.4f}")
    for name, vector in (("D + R", trace_term + residual), ("D alone", trace_term)):
        print(f"  autograd − ({name}): {float((autograd - vector).norm() / autograd.norm()):.3f} of autograd's norm")


def model_samples(model, n: int, generator: torch.Generator) -> torch.Tensor:
    """n exact draws (n, d) from the GRBM: h from its enumerated marginal, then v ~ N(b + σ²Uh, σ²I)."""
    with torch.no_grad():
        d, m = model.W.shape
        states = all_binary(m, model.W)
        uh = states @ model.coupling_weight().T  # (2^m, d)
        log_weights = states @ model.c + uh @ model.b + 0.5 * model.sigma**2 * (uh**2).sum(-1)
        h = states[torch.multinomial(torch.softmax(log_weights, 0), n, replacement=True, generator=generator)]
        return model.visible_mean(h) + model.sigma * torch.randn((n, d), generator=generator)


def path(run_dir: Path, checkpoint: Path | None, batches: int, blur: float, model_data: bool, exact_kl: bool) -> None:
    run = load_at_exact_posterior(run_dir, checkpoint)
    parts = run.parts
    estimator, model, x_all = parts.estimator, parts.model, parts.data.tensor("train")
    if model_data:
        x_all = model_samples(model, len(x_all), torch.Generator().manual_seed(6))
    else:
        x_all = x_all + blur * torch.randn(x_all.shape, generator=torch.Generator().manual_seed(5))
    if exact_kl:
        estimator.divergence.exact = True  # the unrolled steps on the closed-form KL, as [divergence] exact = true
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
        if unroll_steps == 0 and isinstance(estimator.objective, (SM, SSM)):
            trace_term = trace_term_miss(model, parts.posterior, x_all, theta)
            rest = bias - trace_term
            print(
                f"    of which SM's trace term without the data score (closed form): norm {float(trace_term.norm()):.2f}, "
                f"in log σ {float(trace_term[-1]):+.2f};  the rest: norm {float(rest.norm()):.2f}, in log σ {float(rest[-1]):+.2f}"
            )


def train(coupling: str, unroll_steps: int, steps: int, posterior: str, add_trace_term: bool) -> None:
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
    if add_trace_term:  # N = 0 at φ*: hand the partial derivative the trace term's part of the path (closed form)
        partial = estimator.hypergradient
        sizes = [p.numel() for p in estimator.theta]

        def with_trace_term(x, context, energy=None):
            grads, metrics = partial(x, context, energy)
            miss = trace_term_miss(model, parts.posterior, x.detach(), estimator.theta).split(sizes)
            return [g - m.view_as(g) for g, m in zip(grads, miss)], metrics

        estimator.hypergradient = with_trace_term
    for step in range(1, steps + 1):
        estimator.step(x_train[torch.randint(len(x_train), (100,), generator=generator)])
        if step % 2500 == 0:
            with torch.no_grad():
                loglik = float(model.log_likelihood(x_test).mean())
            print(
                f"{coupling}, q {posterior}, N = {unroll_steps}{' + trace term' if add_trace_term else ''}, step {step:6d}: test log-likelihood {loglik:+.4f}  "
                f"exact J(θ) {exact_objective(model, x_train[:20000]):7.2f}  σ {float(model.sigma.detach()):.4f}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("gap").add_argument("run", type=Path)
    at_checkpoint = commands.add_parser("path")
    at_checkpoint.add_argument("run", type=Path)
    at_checkpoint.add_argument("--checkpoint", type=Path, default=None, help="default: the run's last")
    at_checkpoint.add_argument("--batches", type=int, default=200)
    points = at_checkpoint.add_mutually_exclusive_group()
    points.add_argument("--blur", type=float, default=0.0, help="noise added to the training points")
    points.add_argument(
        "--model-data", action="store_true", help="exact draws from the model in place of the training points"
    )
    at_checkpoint.add_argument(
        "--exact-kl", action="store_true", help="unroll on the KL in closed form, not on its one-sample estimate"
    )
    splitting = commands.add_parser("split")
    splitting.add_argument("run", type=Path)
    splitting.add_argument("--checkpoint", type=Path, default=None, help="default: the run's last")
    splitting.add_argument("--blur", type=float, default=0.05, help="the data's Gaussian blur (its score is known)")
    splitting.add_argument("--points", type=int, default=600000)
    splitting.add_argument("--seed", type=int, default=1)
    training = commands.add_parser("train")
    training.add_argument("--coupling", choices=["scaled", "plain"], default="scaled")
    training.add_argument("--unroll-steps", type=int, default=5)
    training.add_argument("--steps", type=int, default=30000)
    training.add_argument("--posterior", choices=["exact", "trained"], default="exact")
    training.add_argument(
        "--add-trace-term", action="store_true", help="with --posterior exact and N = 0: add the trace term's path"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.command == "gap":
        gap(args.run)
    elif args.command == "split":
        split(args.run, args.checkpoint, args.blur, args.points, args.seed)
    elif args.command == "path":
        path(args.run, args.checkpoint, args.batches, args.blur, args.model_data, args.exact_kl)
    else:
        if args.add_trace_term and (args.posterior != "exact" or args.unroll_steps != 0):
            parser.error("--add-trace-term is the closed form at φ* for N = 0: use --posterior exact --unroll-steps 0")
        train(args.coupling, args.unroll_steps, args.steps, args.posterior, args.add_trace_term)


if __name__ == "__main__":
    main()
