"""The contract checks of each kind of component, as plugin authors run them: each asserts the
properties the trainer and the estimators rely on (an identity, a gradient against finite
differences or an exact value, a shape), with a message saying what failed and why it matters."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from eblvm.testing.references import F64, Exact, linear_gaussian_setup, tiny_grbm_setup
from eblvm.testing.runs import read_recipe
from eblvm_core.contracts import (
    DataSplits,
    Divergence,
    EnergyModel,
    LatentSpec,
    Logger,
    Parts,
    Posterior,
    ScoreObjective,
)


def _grads(value: Tensor, params: Sequence[Tensor]) -> list[Tensor]:
    grads = torch.autograd.grad(value, params, allow_unused=True, retain_graph=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


def _mean_and_se(values: Tensor) -> tuple[float, float]:
    return float(values.mean()), float(values.std() / math.sqrt(len(values)))


def check_divergence(
    div: Divergence, setup: Exact | None = None, *, scale: float = 0.5, seeds: int = 3, repeats: int = 256
) -> dict[str, list[float]]:
    """Assert the divergence contract on an exact setup; default: the linear-Gaussian model and,
    unless ``div.requires_continuous_latent``, the tiny GRBM (Bernoulli latents).

    1. ``div(model, q, v)`` is (B,), floating and finite: one value per data point.
    2. At a perturbed q its batch mean has finite gradients in φ (q's parameters), not all zero
       — the lower level is trained on them — and in θ, not all zero: BiSM's hypergradient
       flows through ∂G/∂φ's dependence on θ.
    3. Minimal at the exact posterior: for ``seeds`` random perturbations of q (each parameter
       + scale·N(0, 1)), E[D(q')] − E[D(p(h|v))] > 0 by more than 4 standard errors, the
       expectation over ``repeats`` evaluations of the batch. D is a divergence up to a constant
       in φ, so only this paired difference is meaningful.

    Returns the measured gaps per setup.
    """
    setups = (
        [setup]
        if setup is not None
        else [linear_gaussian_setup()] + ([] if div.requires_continuous_latent else [tiny_grbm_setup()])
    )
    report: dict[str, list[float]] = {}
    for s in setups:
        where = f"{type(div).__name__} on {s.name}"
        model, q, v = s.model, s.posterior, s.v
        s.reset()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            values = div(model, q, v)
            assert isinstance(values, Tensor) and values.shape == (len(v),), (
                f"{where}: must return one value per data point, shape ({len(v)},), got {getattr(values, 'shape', values)!r}"
            )
            assert values.dtype.is_floating_point and torch.isfinite(values).all(), (
                f"{where}: values not finite: {values}"
            )

            s.perturb(scale, seed=100)
            mean = div(model, q, v).mean()
            phi, theta = (
                [p for p in q.parameters() if p.requires_grad],
                [p for p in model.parameters() if p.requires_grad],
            )
            for label, params in (("φ (posterior)", phi), ("θ (model)", theta)):
                grads = _grads(mean, params)
                assert all(torch.isfinite(g).all() for g in grads), f"{where}: gradient in {label} is not finite"
                assert any(g.abs().max() > 0 for g in grads), (
                    f"{where}: no gradient in {label} (is the graph cut, e.g. by .detach() or sample()?)"
                )

            v_rep = v.repeat(repeats, 1)

            def expectation(
                model=model, q=q, v_rep=v_rep, b=len(v)
            ) -> Tensor:  # per repeat, the batch mean: (repeats,)
                return div(model, q, v_rep).detach().view(repeats, b).mean(1)  # grad mode on: D may differentiate in h

            s.reset()
            at_exact = expectation()
            gaps = []
            for seed in range(seeds):
                s.perturb(scale, seed)
                gap, se = _mean_and_se(expectation() - at_exact)
                assert gap > 4 * se and gap > 0, _minimal_failure(where, seed, gap, se, repeats)
                gaps.append(gap)
        s.reset()
        report[s.name] = gaps
    return report


def _minimal_failure(where: str, seed: int, gap: float, se: float, repeats: int) -> str:
    """Why a perturbed q's gap E[D(q')] − E[D(p(h|v))] fails: below zero by more than two standard
    errors (bias: the minimum is elsewhere), or too close to zero to tell from the noise (its
    estimate, its standard error, and what passes)."""
    measured = f"perturbing q (seed {seed}) changed E[D] by {gap:.4g} ± {se:.2g} (standard error, {repeats} repeats)"
    if gap < -2 * se or se == 0:
        return (
            f"{where}: not minimal at the exact posterior: {measured}; a lower level whose minimum is elsewhere "
            "biases BiSM"
        )
    decide = f"about repeats={(4 * se / gap) ** 2 * repeats:.0f}" if gap > 0 else "more repeats"
    return (
        f"{where}: the gap is within noise: {measured}; a pass needs a gap above 4 standard errors "
        f"({4 * se:.3g}): no evidence of bias, but none of minimality either; {decide} (the error falls as "
        "1/√repeats) or a larger scale would decide"
    )


class GaussianScore(nn.Module):
    """The score field s(x) = −A(x − μ) of N(μ, A⁻¹), A = precision·(MMᵀ + I); float64, differentiable in x, μ and M."""

    def __init__(self, d: int, seed: int, scale: float = 0.5, precision: float = 1.0):
        super().__init__()
        self.precision = precision
        g = torch.Generator().manual_seed(seed)
        self.mu = nn.Parameter(torch.randn(d, generator=g, dtype=F64))
        self.M = nn.Parameter(scale * torch.randn(d, d, generator=g, dtype=F64))

    @property
    def A(self) -> Tensor:
        return self.precision * (self.M @ self.M.T + torch.eye(len(self.mu), dtype=F64))

    def forward(self, x: Tensor) -> Tensor:
        return -(x - self.mu) @ self.A

    def sample(self, n: int) -> Tensor:
        """n draws of N(μ, A⁻¹): μ + L⁻ᵀz with A = LLᵀ."""
        L = torch.linalg.cholesky(self.A.detach())
        z = torch.randn(len(self.mu), n, dtype=F64)
        return self.mu.detach() + torch.linalg.solve_triangular(L.T, z, upper=True).T

    def hyvarinen(self, x: Tensor) -> Tensor:
        """½‖s(x)‖² + tr ∇s(x) = ½‖s(x)‖² − tr A, per point (B,)."""
        return 0.5 * (self(x) ** 2).sum(-1) - torch.trace(self.A)


def check_objective(
    objective: ScoreObjective,
    identity: str = "fisher",
    *,
    d: int = 2,
    batches: int = 20,
    batch_size: int | None = None,
    precision: float = 10.0,
    seed: int = 0,
) -> dict[str, float]:
    """Assert the score-objective contract on Gaussian data v ~ N(μ₀, A₀⁻¹) and Gaussian score
    fields s(x) = −A(x − μ) (``GaussianScore``).

    Always: ``points(v)`` gives (x (B', d), context); ``loss`` is (B',) or, for pair statistics,
    one value per pair, floating and finite; its mean has finite, non-zero gradients in the
    score's parameters; a ``value_only`` objective's ``loss`` equals ``loss_at(x, s(x), context)``.

    ``identity="fisher"`` (SM, SSM, DSM): in expectation the loss is Hyvärinen's form at the
    objective's own points, E[loss(s)] = E_x[½‖s(x)‖² − tr A] + C with C independent of s
    (C = 0 for SM/SSM; for DSM, x̃ = v + σε and C = d/(2σ²), since E[sᵀε]/σ = −tr A). Checked
    on the difference of two score fields, which cancels C, to 5 standard errors over
    ``batches`` independent batches.

    ``identity="stein"`` (KSD): Stein's identity E_p[u_p(x, x')] = 0 — the batch mean is 0
    (within 5 standard errors) when s is the score of the data (the points must be the data),
    and positive beyond 5 standard errors for another score.

    ``batch_size`` defaults to 2000 points for "fisher" (DSM's (s₁ − s₂)ᵀε/σ term is noisy) and
    200 for "stein" (pair statistics cost O(B²)). ``precision`` scales A: the data's standard
    deviations are about 1/√precision (≈ 0.3), so that kernels of bandwidth ~0.1 see many pairs.
    """
    assert identity in ("fisher", "stein"), f"identity must be 'fisher' or 'stein', got {identity!r}"
    batch_size = batch_size or (2000 if identity == "fisher" else 200)  # DSM's ε/σ term is noisy; KSD is O(B²)
    name = type(objective).__name__
    truth, other = (
        GaussianScore(d, seed, precision=precision),
        GaussianScore(d, seed + 1, scale=1.0, precision=precision),
    )
    stats: dict[str, list[float]] = {"diff": [], "closed": [], "true": [], "other": []}
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for b in range(batches):
            v = truth.sample(batch_size)
            x, context = objective.points(v)
            assert isinstance(x, Tensor) and x.dim() == 2 and x.shape[1] == d, (
                f"{name}.points must return x (B', {d}), got {getattr(x, 'shape', x)}"
            )
            loss_true, loss_other = objective.loss(truth, x, context), objective.loss(other, x, context)
            assert loss_true.dim() == 1 and loss_true.dtype.is_floating_point and torch.isfinite(loss_true).all(), (
                f"{name}.loss must return finite per-sample losses (B',), got shape {tuple(loss_true.shape)}"
            )
            if b == 0:
                grads = _grads(loss_true.mean(), [truth.mu, truth.M])
                assert all(torch.isfinite(g).all() for g in grads) and any(g.abs().max() > 0 for g in grads), (
                    f"{name}: the loss must be differentiable in the score's parameters (finite, non-zero gradient)"
                )
                if objective.value_only:
                    state = torch.get_rng_state()
                    via_loss = objective.loss(truth, x, context)
                    torch.set_rng_state(state)
                    torch.testing.assert_close(
                        objective.loss_at(x, truth(x), context), via_loss, msg=f"{name}: loss != loss_at(x, s(x))"
                    )
            if identity == "fisher":
                assert loss_true.shape == (len(x),), (
                    f"{name}: a Fisher-type loss has one value per point, got {tuple(loss_true.shape)}"
                )
                closed = (truth.hyvarinen(x) - other.hyvarinen(x)).mean().detach()
                stats["diff"].append(float((loss_true - loss_other).mean().detach() - closed))
                stats["closed"].append(float(closed))
            else:
                assert torch.equal(x, v), f"{name}: Stein's identity is checked at the data; points(v) must return v"
                stats["true"].append(float(loss_true.mean().detach()))
                stats["other"].append(float(loss_other.mean().detach()))
    t = {k: torch.tensor(vals, dtype=F64) for k, vals in stats.items() if vals}
    if identity == "fisher":
        err, se = _mean_and_se(t["diff"])
        signal = float(t["closed"].mean())
        assert abs(signal) > 10 * se, f"{name}: check too noisy to decide (signal {signal:.3g}, se {se:.3g})"
        assert abs(err) <= 5 * se + 1e-9 * (1 + abs(signal)), (
            f"{name}: E[loss(s₁) − loss(s₂)] deviates from the closed form ½E‖s₁‖² − tr A₁ − (½E‖s₂‖² − tr A₂) "
            f"= {signal:.5g} by {err:.3g} (se {se:.2g})"
        )
        return {"closed_form_difference": signal, "error": err, "se": se}
    at_truth, se_truth = _mean_and_se(t["true"])
    at_other, se_other = _mean_and_se(t["other"])
    assert abs(at_truth) <= 5 * se_truth + 1e-9, (
        f"{name}: E[loss] at the data's own score is {at_truth:.3g} ± {se_truth:.2g}, not 0"
    )
    assert at_other > 5 * se_other, f"{name}: E[loss] at a wrong score is {at_other:.3g} ± {se_other:.2g}, not positive"
    return {"at_truth": at_truth, "at_other": at_other}


def _build_with_roles(raw: dict[str, Any], label: str) -> tuple[Any, Parts]:
    """Validate and build a recipe; roles the estimator trains but the recipe leaves out get
    ``[optim.<role>] kind = "adam"``, and sections of roles it does not train are dropped."""
    from eblvm_core.build import build
    from eblvm_core.errors import ConfigError
    from eblvm_core.recipe import validate

    for _ in range(8):
        parsed = validate(raw, label)
        try:
            return parsed, build(parsed, torch.device("cpu")).parts
        except ConfigError as exc:
            section = exc.section or ""
            if not section.startswith("optim."):
                raise
            role = section.removeprefix("optim.")
            if exc.message.startswith("missing: estimator"):
                raw.setdefault("optim", {})[role] = {"kind": "adam"}
            elif exc.message.startswith("unknown role"):
                del raw["optim"][role]
            else:
                raise
    raise AssertionError(f"{label}: could not match the recipe's [optim.*] sections to the estimator's roles")


def check_estimator(
    name: str,
    recipe: str | Path | dict,
    overrides: Sequence[str] = (),
    seed: int = 0,
    *,
    reference: Callable[[Parts, Tensor], list[Tensor]] | None = None,
    draws: int = 32,
    min_cosine: float = 0.9,
) -> dict[str, float]:
    """Build the recipe (its [estimator] kind set to ``name`` when absent) and take one step on a
    training batch; assert it returns finite metrics (floats or 0-d tensors) including "loss"
    (the trainer watches it for NaN/Inf), made one role per declared role with ``parts.make_role``
    (the trainer checkpoints them), and changes parameters of every role. Returns the metrics as floats.

    With ``reference(parts, batch)``, the gradient (one tensor per parameter of ``parts.model``,
    in ``parameters()`` order) of the loss the estimator's model update should descend at the
    built state, also assert the direction: with plain SGD for the "model" role, the update
    −Δθ/lr averaged over ``draws`` steps from the same state (different random draws) has a
    cosine of at least ``min_cosine`` with the reference; a wrong sign gives about −1.
    """
    from eblvm_core.checkpoint import seed_everything
    from eblvm_core.recipe import apply_override

    raw = read_recipe(recipe)
    raw.setdefault("estimator", {"kind": name})
    assert raw["estimator"].get("kind") == name, (
        f"the recipe's [estimator] kind is {raw['estimator'].get('kind')!r}, not {name!r}"
    )
    for override in overrides:
        apply_override(raw, override)
    seed_everything(seed)
    parsed, parts = _build_with_roles(raw, f"<check_estimator {name}>")
    estimator = parts.estimator
    assert sorted(parts.roles) == sorted(estimator.roles), (
        f"{name}: one role per declared role {estimator.roles} (made with parts.make_role), got {sorted(parts.roles)}"
    )
    before = {role_name: [p.detach().clone() for p in role.params] for role_name, role in parts.roles.items()}
    metrics = estimator.step(parts.data.tensor("train", parsed.run.batch_size))
    assert isinstance(metrics, dict) and "loss" in metrics, (
        f"{name}: step must return a dict of metrics with 'loss', got {metrics!r}"
    )
    as_float = {
        k: float(v) if isinstance(v, (int, float)) or (isinstance(v, Tensor) and v.numel() == 1) else v
        for k, v in metrics.items()
    }
    bad = {k: v for k, v in as_float.items() if not isinstance(v, float) or not math.isfinite(v)}
    assert not bad, f"{name}: metrics must be finite floats or 0-d tensors, got {bad}"
    for role_name, role in parts.roles.items():
        moved = any(not torch.equal(b, p) for b, p in zip(before[role_name], role.params))
        assert moved, f"{name}: one step left the parameters of role '{role_name}' unchanged"
    metrics = as_float
    state = estimator.state_dict()
    assert isinstance(state, dict), f"{name}: state_dict must return a dict"
    estimator.load_state_dict(state)
    if reference is not None:
        cosine = _update_cosine(raw, name, reference, draws, seed)
        assert cosine >= min_cosine, (
            f"{name}: the model's update, averaged over {draws} draws, has a cosine of {cosine:.3f} with the "
            f"reference gradient (at least {min_cosine} expected; a wrong sign gives about -1)"
        )
        metrics["reference_cosine"] = cosine
    return metrics


def _update_cosine(
    raw: dict[str, Any], name: str, reference: Callable[[Parts, Tensor], list[Tensor]], draws: int, seed: int
) -> float:
    """cos(mean over draws of −Δθ/lr, reference) for one SGD step of the "model" role from the same state."""
    import copy

    from eblvm_core.checkpoint import seed_everything

    lr = 1e-3
    raw = copy.deepcopy(raw)
    raw.setdefault("optim", {})["model"] = {"kind": "sgd", "lr": lr}
    seed_everything(seed)
    parsed, parts = _build_with_roles(raw, f"<check_estimator {name}>")
    estimator, batch = parts.estimator, parts.data.tensor("train", parsed.run.batch_size)
    theta = list(parts.model.parameters())
    saved = copy.deepcopy(
        (
            {k: net.state_dict() for k, net in parts.networks().items()},
            {role_name: role.state_dict() for role_name, role in parts.roles.items()},
            estimator.state_dict(),
        )
    )
    mean = [torch.zeros_like(p) for p in theta]
    for i in range(draws):
        torch.manual_seed(seed + 1 + i)
        before = [p.detach().clone() for p in theta]
        estimator.step(batch)
        for m, b, p in zip(mean, before, theta):
            m += (b - p.detach()) / (lr * draws)
        nets, opts, state = copy.deepcopy(saved)
        for k, net in parts.networks().items():
            net.load_state_dict(nets[k])
        for role_name, role in parts.roles.items():
            role.load_state_dict(opts[role_name])
        estimator.load_state_dict(state)
    target = torch.cat([g.detach().flatten() for g in reference(parts, batch)])
    update = torch.cat([m.flatten() for m in mean])
    assert target.shape == update.shape, f"{name}: the reference needs one gradient per model parameter"
    return float(update @ target / (update.norm() * target.norm()).clamp_min(1e-300))


def check_model(model: EnergyModel, v: Tensor, *, n_samples: int = 4096, max_enumerated: int = 12) -> dict[str, float]:
    """Assert the model contract on a batch v (B, d).

    1. ``latent`` is a LatentSpec or None; ``energy(v, h)`` for h of that kind and dimension
       (Bernoulli {0,1}, Gaussian N(0, I), none: (B, 0)) is (B,) and finite, and per sample
       (E of the first row alone equals the first entry: estimators stack k samples into the
       batch); it has finite gradients in v and a non-zero gradient in θ.
    2. If ``free_energy`` is defined: it is (B,), and equals −log ∫ exp(−E(v, h)) dh — by
       enumerating h for m ≤ ``max_enumerated`` Bernoulli units, or by importance sampling
       from a Laplace approximation (inflated 1.5×) for Gaussian h, within 5 standard errors.
    3. If ``condition`` is offered: ``condition(v)(h)`` equals ``energy(v, h)``, with the same
       gradients in h and θ.
    """
    name = type(model).__name__
    latent = model.latent
    assert latent is None or isinstance(latent, LatentSpec), f"{name}.latent must be a LatentSpec or None"
    b = len(v)
    v = v.detach().clone().requires_grad_(True)
    if latent is None:
        h = v.new_zeros(b, 0)
    elif latent.kind == "bernoulli":
        h = torch.bernoulli(torch.full((b, latent.dim), 0.5, dtype=v.dtype))
    else:
        h = torch.randn(b, latent.dim, dtype=v.dtype)
    energy = model.energy(v, h)
    assert energy.shape == (b,) and torch.isfinite(energy).all(), (
        f"{name}.energy must return finite (B,) = ({b},), got {tuple(energy.shape)}"
    )
    torch.testing.assert_close(model.energy(v[:1], h[:1]), energy[:1], msg=f"{name}.energy mixes samples of the batch")
    (grad_v,) = torch.autograd.grad(energy.sum(), v, retain_graph=True)
    assert torch.isfinite(grad_v).all(), f"{name}.energy: gradient in v not finite"
    theta = [p for p in model.parameters() if p.requires_grad]
    assert theta and any(g.abs().max() > 0 for g in _grads(energy.sum(), theta)), f"{name}.energy: no gradient in θ"
    if model.has_conditioning and latent is not None:
        h_c = h.detach().clone().requires_grad_(True)
        cached, direct = model.condition(v)(h_c), model.energy(v, h_c)
        torch.testing.assert_close(cached, direct, msg=f"{name}.condition(v)(h) differs from energy(v, h)")
        for a, b_ in zip(_grads(cached.sum(), [h_c, *theta]), _grads(direct.sum(), [h_c, *theta])):
            torch.testing.assert_close(a, b_, msg=f"{name}.condition(v): gradients differ from energy's")
    report: dict[str, float] = {}
    if not model.has_free_energy:
        return report
    free = model.free_energy(v)
    assert free.shape == (b,) and torch.isfinite(free).all(), (
        f"{name}.free_energy must return finite (B,), got {tuple(free.shape)}"
    )
    v = v.detach()
    with torch.no_grad():
        free = model.free_energy(v)
    if latent is None:
        torch.testing.assert_close(free, model.energy(v, h), msg=f"{name}: with no latent, F(v) must equal E(v)")
    elif latent.kind == "bernoulli" and latent.dim <= max_enumerated:
        import itertools

        hs = torch.tensor(list(itertools.product([0.0, 1.0], repeat=latent.dim)), dtype=v.dtype)  # (2^m, m)
        with torch.no_grad():
            e = model.energy(v.repeat_interleave(len(hs), 0), hs.repeat(b, 1)).view(b, len(hs))
        torch.testing.assert_close(free, -torch.logsumexp(-e, 1), msg=f"{name}.free_energy != −log Σ_h exp(−E(v, h))")
        report["max_error"] = float((free + torch.logsumexp(-e, 1)).abs().max())
    elif latent.kind == "gaussian":
        estimate, se = _laplace_free_energy(model, v, n_samples)
        err = (estimate - free).abs()
        assert (err <= 5 * se + 1e-6 * (1 + free.abs())).all(), (
            f"{name}.free_energy != −log ∫ exp(−E) dh: error {err.max():.3g}, se {se.max():.2g}"
        )
        report["max_error"] = float(err.max())
    return report


def check_posterior(posterior: Posterior, v: Tensor, latent: LatentSpec, *, n: int = 2000) -> None:
    """Assert the posterior contract on a batch v (B, d) for a latent of ``latent`` kind and size m.

    ``rsample(v, k)`` is (k, B, m), finite and differentiable in φ (the lower level trains
    through it); ``sample`` is (k, B, m) without a graph, binary for Bernoulli h; ``log_prob``
    maps h (k, B, m) to (k, B) and h (B, m) to (B,); ``mean(v)`` is (B, m) and matches the
    average of ``n`` exact samples within 5 standard errors; for m ≤ 12 Bernoulli units
    Σ_h q(h|v) = 1 by enumeration.
    """
    name, b, m = type(posterior).__name__, len(v), latent.dim
    h = posterior.rsample(v, 3)
    assert h.shape == (3, b, m) and torch.isfinite(h).all(), (
        f"{name}.rsample must return finite (n, B, m) = (3, {b}, {m}), got {tuple(h.shape)}"
    )
    phi = [p for p in posterior.parameters() if p.requires_grad]
    assert any(g.abs().max() > 0 for g in _grads(h.sum(), phi)), f"{name}.rsample is not differentiable in φ"
    draws = posterior.sample(v, n)
    assert draws.shape == (n, b, m) and not draws.requires_grad, f"{name}.sample must return (n, B, m) without a graph"
    if latent.kind == "bernoulli":
        assert ((draws == 0) | (draws == 1)).all(), f"{name}.sample must return exact binary draws"
    lp = posterior.log_prob(draws[:2], v)
    assert lp.shape == (2, b) and torch.isfinite(lp).all(), (
        f"{name}.log_prob of (n, B, m) must be finite (n, B), got {tuple(lp.shape)}"
    )
    torch.testing.assert_close(posterior.log_prob(draws[0], v), lp[0], msg=f"{name}.log_prob of h (B, m) must be (B,)")
    mean = posterior.mean(v).detach()
    se = draws.std(0) / math.sqrt(n)
    assert mean.shape == (b, m) and ((draws.mean(0) - mean).abs() <= 5 * se + 1e-6).all(), (
        f"{name}.mean disagrees with the mean of its samples"
    )
    if latent.kind == "bernoulli" and m <= 12:
        import itertools

        hs = torch.tensor(list(itertools.product([0.0, 1.0], repeat=m)), dtype=v.dtype)[:, None].expand(-1, b, m)
        total = torch.logsumexp(posterior.log_prob(hs, v).detach(), 0)
        torch.testing.assert_close(total, torch.zeros_like(total), msg=f"{name}: q(h|v) does not sum to 1 over h")


def check_dataset(data: DataSplits, n: int = 256) -> None:
    """Assert a dataset factory's result: DataSplits whose train/test (and val) splits, prepared
    (up to ``n`` examples each), are non-empty finite float tensors (N, *event_shape), inside
    ``bounds`` when given (per flattened dimension)."""
    assert isinstance(data, DataSplits), f"a dataset factory must return DataSplits, got {type(data).__name__}"
    for split in ("train", "test", "val"):
        if not data.has(split) and split == "val":
            continue
        assert data.has(split) and data.size(split) > 0, f"{split} must be a non-empty split"
        x = data.tensor(split, n)
        assert isinstance(x, Tensor) and x.dtype.is_floating_point and torch.isfinite(x).all(), (
            f"{split} must prepare to finite floats"
        )
        assert tuple(x.shape[1:]) == data.shape, (
            f"{split} has shape {tuple(x.shape[1:])}, the event shape is {data.shape}"
        )
        if data.bounds is not None:
            assert len(data.bounds) == data.dim, "bounds needs one (low, high) per dimension"
            flat = x.flatten(1)
            for j, (lo, hi) in enumerate(data.bounds):
                assert lo <= flat[:, j].min() and flat[:, j].max() <= hi, (
                    f"{split}[:, {j}] leaves its bounds ({lo}, {hi})"
                )


def check_sampler(sampler: Any, model: EnergyModel, shape: int | tuple[int, ...], n: int = 8) -> None:
    """Assert ``sampler.sample(model, n, generator)`` is finite (n, *shape) (shape: the event shape,
    or d) and reproducible given the generator's seed, and that ``draw`` gives the same samples with
    finite diagnostics under the keys ``diagnostics_keys`` promises."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    first = sampler.sample(model, n, torch.Generator().manual_seed(0))
    assert first.shape == (n, *shape) and torch.isfinite(first).all(), (
        f"samples must be finite {(n, *shape)}, got {tuple(first.shape)}"
    )
    torch.testing.assert_close(
        sampler.sample(model, n, torch.Generator().manual_seed(0)),
        first,
        msg="the same seed must give the same samples",
    )
    drawn = sampler.draw(model, n, torch.Generator().manual_seed(0))
    torch.testing.assert_close(drawn.samples, first, msg="draw must give the samples sample gives for the same seed")
    promised = tuple(sampler.diagnostics_keys(model, n))
    assert tuple(drawn.diagnostics) == promised, f"diagnostics {list(drawn.diagnostics)}, promised {list(promised)}"
    for key, value in drawn.diagnostics.items():
        assert isinstance(value, float) and math.isfinite(value), f"diagnostic {key} = {value!r} is not a finite float"


def check_evaluator(evaluator: Any, parts: Parts) -> Any:
    """Assert ``evaluator(parts)`` returns an EvalResult of finite float scalars and (C, H, W) images in [0, 1]."""
    from eblvm_core.contracts import EvalResult

    result = evaluator(parts)
    assert isinstance(result, EvalResult), f"an evaluator must return EvalResult, got {type(result).__name__}"
    assert result.scalars or result.images, "an evaluator must report something"
    for key, value in result.scalars.items():
        assert isinstance(value, (int, float)) and math.isfinite(value), (
            f"scalar {key} = {value!r} is not a finite float"
        )
    for key, image in result.images.items():
        assert image.dim() == 3 and image.min() >= 0 and image.max() <= 1, f"image {key} must be (C, H, W) in [0, 1]"
    return result


def check_logger(logger: Any, run_dir: Path) -> None:
    """Assert a logger accepts scalars, images and (where it records them) hyper-parameters and
    closes, writing only inside ``run_dir``."""
    before = set(Path(run_dir).parent.iterdir())
    logger.log_scalars(1, {"train/loss": 0.5})
    logger.log_images(1, {"eval/x/image": torch.rand(3, 4, 4)})
    assert isinstance(logger, Logger), f"a logger factory must return a Logger, got {type(logger).__name__}"
    logger.log_evaluation(1, {"eval/x/y": 0.25}, "last")
    logger.log_hparams({"model.n_hidden": 4, "optim.model.lr": 1e-3, "model.kind": "grbm"}, {"eval/x/y": 0.5})
    logger.close()
    assert set(Path(run_dir).parent.iterdir()) <= before | {Path(run_dir)}, (
        "a logger must write inside its run directory"
    )


def check_optimizer(optimizer: Any, param: Tensor) -> None:
    """Assert an optimizer factory's result is a torch optimizer over ``param`` that a role's update moves."""
    from eblvm_core.roles import TrainingRole

    assert isinstance(optimizer, torch.optim.Optimizer), (
        f"an optimizer factory must return a torch optimizer, got {type(optimizer).__name__}"
    )
    before = param.detach().clone()
    norm = TrainingRole("check", optimizer).update((param**2).sum())
    assert math.isfinite(norm) and not torch.equal(before, param.detach()), "one step did not move the parameter"


def _laplace_free_energy(model: EnergyModel, v: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """−log ∫ exp(−E(v, h)) dh by importance sampling from N(mode, 1.5² H⁻¹) per point, and its standard error."""
    latent = model.latent
    assert latent is not None, "a model with continuous latents"
    b, m = len(v), latent.dim
    h = torch.zeros(b, m, dtype=v.dtype, requires_grad=True)
    opt = torch.optim.LBFGS([h], max_iter=200, tolerance_grad=1e-10, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        e = model.energy(v, h).sum()
        (h.grad,) = torch.autograd.grad(e, h)
        return e.detach()

    opt.step(closure)
    (g,) = torch.autograd.grad(model.energy(v, h).sum(), h, create_graph=True)
    hess = torch.stack([torch.autograd.grad(g[:, i].sum(), h, retain_graph=True)[0] for i in range(m)], 1)  # (B, m, m)
    cov = 1.5**2 * torch.linalg.inv(hess.detach())
    proposal = torch.distributions.MultivariateNormal(h.detach(), covariance_matrix=0.5 * (cov + cov.transpose(1, 2)))
    with torch.no_grad():
        hs = proposal.sample((n,))  # (n, B, m)
        e = model.energy(v.repeat(n, 1), hs.reshape(n * b, m)).view(n, b)
        log_w = -e - proposal.log_prob(hs)
        w = torch.exp(log_w - log_w.max(0).values)
        se = w.std(0) / (w.mean(0) * math.sqrt(n))
    return -(torch.logsumexp(log_w, 0) - math.log(n)), se
