"""BiSSM's expected model update at a trained checkerboard GRBM, beside the exact score-matching
gradient, with the posterior and the unrolled steps varied one at a time (docs/results.md).

    python studies/bissm_expected_update.py RUN_DIR [RUN_DIR ...] [--batches 2000] [--only 'α = 3']

Not a timing. For each run directory (a grbm_bissm or grbm_ssm run, either coupling: the run's
own [model] table is used; its last checkpoint is loaded, or ``--checkpoint``) it prints the
exact SM gradient of the training set, g = ∇_θ mean[½‖∇log p‖² + tr ∇²log p] (the expectation
of SSM's), and for each variant the mean of BiSSM's hypergradient over ``--batches`` random
batches of the recipe's size with its standard error, the distance of that mean from g, and the
distance's own Monte-Carlo floor √(tr Cov / batches). Where BiSSM's
training has settled, its expected update is about 0; a distance from g well above the floor
there is the bias that moves its fixed point away from SSM's. The variants: the trained q or
the exact posterior (representable: linear logits), the recipe's N = 5 unrolled steps at step
1.0, more relaxed samples per point in the lower level's gradient (less noise in φ_N), longer
or no unrolls, a larger unrolled step α, a lower relaxation temperature T; and, as a control,
exact-score SSM, whose mean must reach g within its floor. It also prints, per hidden unit, the
eigenvalues of the lower level's Hessian (exact Bernoulli KL) in that unit's posterior
parameters: unrolled steps of a stable size α < 2/λ_max follow φ*(θ) along an eigen-direction
only after about 1/(αλ) of them. The K real posterior steps of each training step are left out (q is at its fit).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import tomllib
from pathlib import Path

import torch
from eblvm_bism import BiSMImplicit
from eblvm_score.objectives import SM

from eblvm.api import toml_value
from eblvm_core import checkpoint as ckpt
from eblvm_core.build import build
from eblvm_core.contracts import exact_score
from eblvm_core.recipe import load_recipe

VARIANTS = [  # (label, exact q, unrolled steps N, their step α, relaxed samples per point in the lower level)
    ("trained q, N = 5, α = 1, 1 sample (the recipe)", False, 5, 1.0, 1),
    ("trained q, N = 5, α = 1, 64 samples", False, 5, 1.0, 64),
    ("exact q, N = 5, α = 1, 1 sample", True, 5, 1.0, 1),
    ("exact q, N = 5, α = 1, 64 samples", True, 5, 1.0, 64),
    ("exact q, N = 20, α = 1, 64 samples", True, 20, 1.0, 64),
    ("exact q, N = 100, α = 1, 64 samples", True, 100, 1.0, 64),
    ("exact q, N = 200, α = 10, 64 samples", True, 200, 10.0, 64),
    ("trained q, N = 200, α = 10, 1 sample", False, 200, 10.0, 1),
    ("exact q, N = 0 (partial derivative)", True, 0, 1.0, 1),
    ("exact q, N = 5, α = 1, 64 samples, T = 0.03", True, 5, 1.0, 64),
    ("exact q, N = 5, α = 1, 64 samples, T = 0.01", True, 5, 1.0, 64),
    ("trained q, N = 5, α = 3, 1 sample", False, 5, 3.0, 1),
    ("trained q, N = 5, α = 10, 1 sample", False, 5, 10.0, 1),
    ("trained q, N = 5, α = 30, 1 sample", False, 5, 30.0, 1),
]
# The flat-direction options (docs/results.md, "Why BiSSM plateaus below SSM"):
# (label, exact q, N, α, samples, options), options among ``exact_kl`` ([divergence] exact),
# ``natural`` (unroll = "natural" with that natural_damping) and ``implicit`` (bism-implicit with
# hessian = "fisher-blocks" and that damping).
FLAT_VARIANTS = [
    ("exact KL, N = 5, α = 1 (sgd)", False, 5, 1.0, 1, {"exact_kl": True}),
    ("exact KL, N = 100, α = 1 (sgd)", False, 100, 1.0, 1, {"exact_kl": True}),
    ("natural N = 1, λ = 1e-6, 1 sample", False, 1, 1.0, 1, {"natural": 1e-6}),
    ("natural N = 5, λ = 1e-6, 1 sample", False, 5, 1.0, 1, {"natural": 1e-6}),
    ("natural N = 1, λ = 1e-3, 1 sample", False, 1, 1.0, 1, {"natural": 1e-3}),
    ("natural N = 1, λ = 1e-6, exact KL", False, 1, 1.0, 1, {"natural": 1e-6, "exact_kl": True}),
    ("natural N = 1, λ = 1e-4, exact KL", False, 1, 1.0, 1, {"natural": 1e-4, "exact_kl": True}),
    ("natural N = 1, λ = 1e-8, exact KL", False, 1, 1.0, 1, {"natural": 1e-8, "exact_kl": True}),
    ("natural N = 5, λ = 1e-6, exact KL", False, 5, 1.0, 1, {"natural": 1e-6, "exact_kl": True}),
    ("exact q, natural N = 1, λ = 1e-6, exact KL", True, 1, 1.0, 1, {"natural": 1e-6, "exact_kl": True}),
    ("implicit blocks, λ = 1e-6, 1 sample", False, 0, 1.0, 1, {"implicit": 1e-6}),
    ("implicit blocks, λ = 1e-6, exact KL", False, 0, 1.0, 1, {"implicit": 1e-6, "exact_kl": True}),
]


def bissm_parts(run_dir: Path, checkpoint: Path | None = None):
    """The run's parts rebuilt as a BiSSM (K = N = 5, sgd, step 1.0, T = 0.1) with the checkpoint's
    networks (the last one unless given) and the run's own [model] table (its coupling above all)."""
    state = ckpt.read_checkpoint(checkpoint or ckpt.last_checkpoint(run_dir))
    with open(run_dir / "recipe.toml", "rb") as file:
        model_table = tomllib.load(file)["model"]
    recipe = load_recipe(
        Path(__file__).resolve().parents[1] / "recipes" / "grbm_bissm.toml",
        [f"model.{key}={toml_value(value)}" for key, value in model_table.items()],
    )
    built = build(recipe, torch.device("cpu"))
    for name, net in built.parts.networks().items():
        if name in state["networks"]:
            net.load_state_dict(state["networks"][name])
    return built.parts, int(state["step"]), "posterior" in state["networks"]


def exact_sm_gradient(parts, x: torch.Tensor) -> list[torch.Tensor]:
    """∇_θ of the mean SM loss ½‖s‖² + tr ∇s with the exact score s = −∇F, over x (n, d)."""
    loss = SM().loss(functools.partial(exact_score, parts.model), x, None).mean()
    return list(torch.autograd.grad(loss, [p for p in parts.model.parameters() if p.requires_grad]))


def set_exact_posterior(parts) -> None:
    """q's linear logits := the GRBM posterior's, c + Uᵀv."""
    with torch.no_grad():
        parts.posterior.net[0].weight.copy_(parts.model.coupling_weight().T)
        parts.posterior.net[0].bias.copy_(parts.model.c)


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument(
        "--checkpoint", type=Path, default=None, help="a checkpoint file (one run only; default: its last)"
    )
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--only", nargs="+", default=None, help="only the variants whose label contains one of these")
    args = parser.parse_args()
    if args.checkpoint and len(args.runs) > 1:
        parser.error("--checkpoint names one run's checkpoint: give one run directory")
    torch.set_num_threads(1)
    for run_dir in args.runs:
        parts, step, has_q = bissm_parts(run_dir, args.checkpoint)
        estimator, x_all = parts.estimator, parts.data.tensor("train")
        names = [n for n, p in parts.model.named_parameters() if p.requires_grad]
        exact = flat(exact_sm_gradient(parts, x_all))
        trained = {k: v.detach().clone() for k, v in parts.posterior.state_dict().items()}
        temperature = parts.posterior.temperature
        print(f"\n{run_dir} (step {step}; parameters {', '.join(names)})")
        components = [
            f"{n}{list(i) if p.dim() else ''}"
            for n, p in parts.model.named_parameters()
            if p.requires_grad
            for i in (itertools.product(*map(range, p.shape)) if p.dim() else [()])
        ]
        with torch.no_grad():
            p = torch.sigmoid(parts.model.hidden_logits(x_all))
            z = torch.cat([torch.ones(len(x_all), 1), x_all.flatten(1)], 1)  # unit j's logit is φ_jᵀz
            curvature = p * (1 - p)
            hessians = [
                (curvature[:, j, None, None] * z[:, :, None] * z[:, None, :]).mean(0) for j in range(p.shape[1])
            ]
        print(
            "exact posterior per hidden unit on the training set: mean p(h=1|v) "
            + " ".join(f"{float(v):.3f}" for v in p.mean(0))
            + "; eigenvalues of the lower level's Hessian in each unit's (bias, weights), E[p(1-p) z zᵀ]: "
            + "  ".join("/".join(f"{float(e):.1e}" for e in torch.linalg.eigvalsh(h)) for h in hessians)
        )
        print(
            f"exact SM gradient g: norm {float(exact.norm()):.3f}  "
            + "  ".join(f"{name} {float(v):+.2f}" for name, v in zip(components, exact))
        )
        control = []  # exact-score SSM on the same batches: how close the baseline's own mean gets to g
        generator = torch.Generator().manual_seed(0)
        torch.manual_seed(0)  # the projections, as for the variants below
        theta = [p for p in parts.model.parameters() if p.requires_grad]
        for _ in range(args.batches):
            x = x_all[torch.randint(len(x_all), (args.batch_size,), generator=generator)]
            points, context = estimator.objective.points(x)
            loss = estimator.objective.loss(functools.partial(exact_score, parts.model), points, context).mean()
            control.append(flat(list(torch.autograd.grad(loss, theta))) - flat(exact_sm_gradient(parts, x)))
        control = torch.stack(control)
        floor = control.var(0).sum().div(args.batches).sqrt()
        print(
            f"  {'exact-score SSM (control)':42s} ‖E[ĝ − g]‖ {float(control.mean(0).norm()):6.3f} (floor {float(floor):.3f})"
        )
        unrolled = estimator
        for label, exact_q, unroll_steps, step, samples, *more in VARIANTS + FLAT_VARIANTS:
            if args.only and not any(word in label for word in args.only):
                continue
            if not exact_q and not has_q:
                continue
            options = more[0] if more else {}
            parts.posterior.load_state_dict(trained)
            if exact_q:
                set_exact_posterior(parts)
            estimator = unrolled
            if "implicit" in options:
                estimator = BiSMImplicit(parts, unrolled.inner_steps, None, block_damping=options["implicit"])
            estimator.divergence.n_samples = samples
            estimator.divergence.exact = options.get("exact_kl", False)
            estimator.unroll_steps, estimator.inner_lr = unroll_steps, step
            estimator.unroll = "natural" if "natural" in options else "sgd"
            estimator.natural_damping = options.get("natural", 0.0)
            parts.posterior.temperature = float(label.split("T = ")[1]) if "T = " in label else temperature
            generator = torch.Generator().manual_seed(0)
            torch.manual_seed(0)
            differences = []
            for _ in range(args.batches):
                idx = torch.randint(len(x_all), (args.batch_size,), generator=generator)
                x, context = estimator.objective.points(x_all[idx])
                bissm = flat(estimator.hypergradient(x, context)[0]).detach()
                differences.append(bissm - flat(exact_sm_gradient(parts, x_all[idx])))  # the batch's noise cancels
            differences = torch.stack(differences)
            bias, floor = differences.mean(0), differences.var(0).sum().div(args.batches).sqrt()
            parts_of_bias = "  ".join(f"{name} {float(b):+.2f}" for name, b in zip(components, bias))
            spread = float(floor) * args.batches**0.5  # one batch's ‖ĝ − g − E[ĝ − g]‖, root mean square
            print(
                f"  {label:42s} ‖E[ĝ − g]‖ {float(bias.norm()):6.3f} (floor {float(floor):.3f}, "
                f"one batch's sd {spread:.3g})  {parts_of_bias}"
            )


if __name__ == "__main__":
    main()
