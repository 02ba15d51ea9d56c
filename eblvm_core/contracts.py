"""The interfaces every component implements.

Shapes are per batch ``B``: v is (B, *event_shape) (vectors (B, d), images (B, C, H, W); d is
the flattened size), h is (B, m). Energies follow the sign convention p(v, h) ∝ exp(-E(v, h)): lower energy, higher density.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal

import attrs
import torch
from torch import Tensor, nn

from eblvm_core.registry import SECTION_KINDS, Registry
from eblvm_core.roles import TrainingRole

ScoreField = Callable[[Tensor], Tensor]
"""A callable x (B, *event_shape) -> estimate of ∇_x log p(x), shaped like x, differentiable in x and θ."""


@attrs.frozen
class LatentSpec:
    """What the latent variable h is: its kind and its dimension m."""

    kind: Literal["bernoulli", "gaussian"]
    dim: int


class EnergyModel(nn.Module):
    """An energy-based (latent variable) model p(v, h; θ) = exp(-E(v, h; θ)) / Z(θ).

    Subclasses set ``latent`` (None for fully visible models, whose ``energy`` ignores h) and
    implement ``energy``. Optional capabilities, declared by overriding the method (the
    ``has_*`` properties say which a model has):

    - ``free_energy`` where h can be summed out: the exact marginal score, exact-score
      baselines and exact likelihoods.
    - ``condition`` where E(v, h) computes something expensive from v alone (the deep EBLVM's
      features f(v) in E = g(f(v), h)): estimators that evaluate E at one batch v for many h at
      fixed θ (BiSM's K real and N unrolled lower-level steps and its upper level, VaGES's
      lower level and Langevin steps on h) then compute it once per update instead of once per
      evaluation. Models without it are evaluated through ``energy`` as before.
    - ``gibbs_sweep`` where p(h | v) and p(v | h) can be drawn exactly at any inverse temperature
      (GRBM): parallel tempering's Gibbs moves.
    """

    latent: LatentSpec | None = None

    def energy(self, v: Tensor, h: Tensor) -> Tensor:
        """E(v, h; θ): v (B, *event_shape), h (B, m) -> (B,)."""
        raise NotImplementedError

    def free_energy(self, v: Tensor) -> Tensor:
        """F(v; θ) = -log Σ_h exp(-E(v, h)): v (B, *event_shape) -> (B,). Optional."""
        raise NotImplementedError(f"{type(self).__name__} has no tractable free energy")

    def condition(self, v: Tensor) -> Conditioned:
        """E(v, ·; θ) at this batch v (B, *event_shape): a ``Conditioned`` whose call maps h
        (..., B, m) -> (..., B) and equals ``energy(v, h)`` (up to rounding), computing what
        depends on v alone now, once, with the graph autograd records here (call it under
        ``torch.no_grad()`` where θ and v need no gradient through it). Optional.

        A model that offers it returns ``Conditioned(self, v, cache, evaluate)`` with
        ``cache`` (a tensor or a tuple of tensors) computed from v and θ, and ``evaluate(cache,
        h)`` the rest of the energy, broadcasting over h's leading dimensions; ``energy(v, h)``
        should be ``evaluate(<cache of v>, h)``, the same operations. The default caches
        nothing: every evaluation is ``energy(v, h)``.
        """
        return Conditioned(self, v)

    def gibbs_sweep(self, v: Tensor, beta: Tensor, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """One block-Gibbs sweep of p_β(v, h) ∝ exp(−β E(v, h)) at inverse temperatures β (B,):
        h ~ p_β(h | v), then v' ~ p_β(v' | h); v (B, *event_shape) -> (v' (B, *event_shape), h (B, m)),
        a draw of p_β(v, h) when v is one of p_β(v). Draws from ``generator``. Optional."""
        raise NotImplementedError(f"{type(self).__name__} has no block-Gibbs sweep")

    @property
    def has_free_energy(self) -> bool:
        return type(self).free_energy is not EnergyModel.free_energy

    @property
    def has_gibbs_sweep(self) -> bool:
        return type(self).gibbs_sweep is not EnergyModel.gibbs_sweep

    @property
    def has_conditioning(self) -> bool:
        return type(self).condition is not EnergyModel.condition


class Conditioned:
    """The energy of ``model`` at one batch ``v``: h ↦ E(v, h; θ), made by ``model.condition(v)``.

    ``conditioned(h)`` maps h (..., B, m) -> (..., B) from the cache of v. It also stands in for
    the model wherever the model is evaluated at these points, e.g. as a ``Divergence``'s
    ``model`` argument: ``energy(x, h)`` reuses the cache when ``x`` is ``v`` itself (the same
    tensor object, not modified in place since) and is the model's full ``energy(x, h)`` for any
    other tensor; every other attribute (``latent``, ``free_energy``, ``parameters()``...) is the
    model's, and ``model`` is the model itself. The cache is a function of θ and v fixed when it
    was computed: a Conditioned is valid until θ changes, so it lives for one update.
    """

    __slots__ = ("model", "v", "cache", "_evaluate", "_version")

    def __init__(
        self,
        model: EnergyModel,
        v: Tensor,
        cache: Any = None,
        evaluate: Callable[[Any, Tensor], Tensor] | None = None,
    ):
        self.model, self.v, self.cache, self._evaluate = model, v, cache, evaluate
        self._version = v._version

    def __call__(self, h: Tensor) -> Tensor:
        """E(v, h): h (..., B, m) -> (..., B)."""
        if self._evaluate is not None:
            return self._evaluate(self.cache, h)
        if h.dim() == 2:
            return self.model.energy(self.v, h)
        lead, (b, m) = h.shape[:-2], h.shape[-2:]
        k = math.prod(lead)
        v = self.v.unsqueeze(0).expand(k, *self.v.shape).reshape(k * b, *self.v.shape[1:])
        return self.model.energy(v, h.reshape(k * b, m)).view(*lead, b)

    def conditions(self, x: Tensor) -> bool:
        """Whether ``x`` is the batch this energy is conditioned on (the same, unmodified tensor)."""
        return x is self.v and x._version == self._version

    def energy(self, x: Tensor, h: Tensor) -> Tensor:
        """E(x, h), the model's ``energy`` contract: from the cache when x is v, else in full."""
        return self(h) if self.conditions(x) else self.model.energy(x, h)

    def detach(self, v: Tensor | None = None) -> Conditioned:
        """The same energy with the cache cut from the graph: θ (and v) get no gradient through it.
        ``v``: the points it is then conditioned on, a tensor holding v's values (e.g.
        ``v.detach()``); default v itself."""
        cache = self.cache
        if isinstance(cache, Tensor):
            cache = cache.detach()
        elif isinstance(cache, tuple):
            cache = tuple(c.detach() if isinstance(c, Tensor) else c for c in cache)
        other = Conditioned(self.model, self.v if v is None else v, cache, self._evaluate)
        if v is None:
            other._version = self._version
        return other

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in Conditioned.__slots__:
            raise AttributeError(name)
        return getattr(self.model, name)


def energies(model: EnergyModel | Conditioned, v: Tensor, h: Tensor) -> Tensor:
    """E(v, h_i) for samples h (k, B, m): -> (k, B). From the cache when ``model`` is conditioned
    on v; otherwise the samples are flattened into one batch of k·B through ``model.energy``."""
    if isinstance(model, Conditioned) and model.conditions(v):
        return model(h)
    k, b = h.shape[:2]
    vk = v if k == 1 else v.unsqueeze(0).expand(k, *v.shape).reshape(k * b, *v.shape[1:])
    return model.energy(vk, h.reshape(k * b, -1)).view(k, b)


def exact_score(model: EnergyModel, v: Tensor, create_graph: bool = True) -> Tensor:
    """The marginal score ∇_v log p(v) = -∇_v F(v), shaped like v.

    The graph w.r.t. ``v`` and θ is kept when ``create_graph`` is true, so the result can be
    differentiated again (SM, SSM) or trained through.
    """
    if not v.requires_grad:
        v = v.detach().requires_grad_(True)
    free = model.free_energy(v).sum()
    (grad,) = torch.autograd.grad(free, v, create_graph=create_graph)
    return -grad


class Posterior(nn.Module):
    """A variational posterior q(h | v; φ)."""

    def rsample(self, v: Tensor, n: int = 1) -> Tensor:
        """n samples, differentiable in φ: v (B, ...) -> h (n, B, m).

        Reparameterised for continuous h; a Gumbel-softmax relaxation for Bernoulli h.
        """
        raise NotImplementedError

    def sample(self, v: Tensor, n: int = 1) -> Tensor:
        """n exact samples, not differentiable: v (B, ...) -> h (n, B, m).

        Defaults to detached ``rsample``; posteriors whose ``rsample`` is a relaxation (Bernoulli)
        override it with exact draws.
        """
        with torch.no_grad():
            return self.rsample(v, n)

    def log_prob(self, h: Tensor, v: Tensor) -> Tensor:
        """log q(h | v): h (..., B, m), v (B, ...) -> (..., B)."""
        raise NotImplementedError

    def mean(self, v: Tensor) -> Tensor:
        """E_q[h | v]: v (B, ...) -> (B, m)."""
        raise NotImplementedError

    def rsample_and_log_prob(self, v: Tensor, n: int = 1) -> tuple[Tensor, Tensor]:
        """``rsample(v, n)`` (n, B, m) and its ``log_prob`` (n, B) in one go; posteriors
        override it to evaluate their network once (lower-level divergences call it)."""
        h = self.rsample(v, n)
        return h, self.log_prob(h, v)


class ScoreObjective:
    """A score-matching functional F (BiSM Eq. 7): per-sample losses given a score field.

    ``points(v)`` says where the score is evaluated (v itself, or a noisy ṽ for DSM) and
    returns a context the loss needs; ``loss`` evaluates the objective. Objectives that use
    the score only through its values at those points set ``value_only = True`` and
    implement ``loss_at``; VaGES relies on that form.
    """

    value_only: bool = False

    def points(self, v: Tensor) -> tuple[Tensor, Any]:
        """Where the score is needed: v (B, ...) -> (x (B', ...), context)."""
        return v, None

    def loss(self, score: ScoreField, x: Tensor, context: Any) -> Tensor:
        """Per-sample losses (B',) for the score field at the points ``x``."""
        if not self.value_only:
            raise NotImplementedError
        return self.loss_at(x, score(x), context)

    def loss_at(self, x: Tensor, s: Tensor, context: Any) -> Tensor:
        """Per-sample losses (B',) from score values s at the points x (both (B', ...))."""
        raise NotImplementedError(f"{type(self).__name__} needs the score's Jacobian")

    def point_weights(self, context: Any) -> Tensor | None:
        """Weights w (B',) of the points in a bi-level estimator's lower level, G = mean w_i·D_i
        (None: all 1), from ``points``' context."""
        return None


class Divergence:
    """A lower-level divergence D(q(h|v) ‖ p(h|v)), per sample, up to a constant in φ.

    It may use only the model's energy and the posterior, never p(h|v) itself.
    ``requires_continuous_latent`` marks divergences that differentiate in h. Estimators may
    pass, as ``model``, a ``Conditioned`` energy at the points v (``model.condition(v)``), which
    evaluates ``energy(v, h)`` from features of v computed once: call it with v as received
    (``energies(model, v, h)`` for k samples).
    """

    requires_continuous_latent: bool = False

    def __call__(self, model: EnergyModel | Conditioned, posterior: Posterior, v: Tensor) -> Tensor:
        """v (B, ...) -> (B,); differentiable in φ (and in θ)."""
        raise NotImplementedError


class Estimator:
    """A learning algorithm: one call to ``step`` consumes one batch and updates parameters.

    ``roles`` names the sets of parameters it trains (``model``, ``posterior``; BiDVL:
    ``energy``, ``encoder``, ``generator``); the recipe gives ``[optim.<role>]`` for each, no
    more and no fewer. The estimator makes each with ``parts.make_role(role, params)``, a
    ``TrainingRole`` whose ``update(loss)`` is the one way its parameters change; the trainer
    checkpoints, restores, NaN-checks, schedules, averages and logs every role the same way
    (``lr/<role>``, ``grad_norm/<role>``). ``precisions`` lists the ``[run] precision`` values it
    supports (fp32 only unless a test shows more is safe), ``precision_note`` why not more (said
    when a recipe asks for another). ``step`` returns metrics as floats or
    0-d tensors (tensors avoid a host synchronisation per step); the key ``loss`` is the training
    loss the trainer watches for NaN/Inf. Extra state to checkpoint (persistent chains, counters)
    goes through ``state_dict`` / ``load_state_dict``. ``graph_safe`` declares that on a GPU the
    step may be captured once in a CUDA graph and replayed (``eblvm_core.graphs``): it launches
    the same kernels on same-shaped tensors every step, never reads a device value on the host,
    returns only tensors, and changes its state (parameters, optimizer moments, buffers) in place.
    The same makes it compilable on a CPU (``eblvm_core.compiled``); ``not_graph_safe`` says why a
    step is not, in the log line of a run that trains it eagerly. An estimator graph-safe under some
    of its options only says so per config in ``graph_safety``.
    """

    roles: tuple[str, ...] = ("model",)
    precisions: tuple[str, ...] = ("fp32",)
    precision_note: str = ""
    graph_safe: bool = False
    not_graph_safe: str = "the estimator does not declare its step graph-safe"

    @classmethod
    def graph_safety(cls, config: Any) -> str | None:
        """Why the step made from ``config`` (the estimator's attrs config) is not graph-safe, or
        None where it is; read before anything is built. By default ``graph_safe``'s verdict for
        every config."""
        return None if cls.graph_safe else cls.not_graph_safe

    def step(self, batch: Tensor) -> Mapping[str, float | Tensor]:
        """batch (B, *event_shape) -> metrics; updates parameters through its roles' ``update``."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""


def _event_shape(shape: Iterable[int] | None) -> tuple[int, ...] | None:
    """A data set's event shape as a tuple; None until ``DataSplits`` reads it off its first example."""
    return None if shape is None else tuple(shape)


@attrs.frozen
class DataSplits:
    """A data set: train, test and (optionally) val splits of examples shaped ``event_shape``.

    A split is a tensor (N, *event_shape) held in memory (moved to the run's device; float, or
    uint8 images that ``prepare`` maps to floats), or a ``torch.utils.data.Dataset`` of
    examples read by ``workers`` DataLoader processes (image folders). ``prepare`` maps a raw
    batch to model input on the device (uint8 -> float in the data set's value range; the
    identity for float data); ``augment(batch, generator)`` draws the training-time random
    transforms (flips, dequantisation noise), reproducibly from the generator. Images are
    (C, H, W). ``bounds`` is the box the data live in ((low, high) per flattened dimension)
    where known; plots and grid integrals use it. ``labels`` maps a split to its class labels
    (N,) where the data set has them (probes and plots use them; training never does).
    """

    train: Any
    test: Any
    val: Any = None
    bounds: tuple[tuple[float, float], ...] | None = None
    event_shape: tuple[int, ...] = attrs.field(default=None, converter=_event_shape)
    prepare: Callable[[Tensor], Tensor] | None = None
    augment: Callable[[Tensor, torch.Generator], Tensor] | None = None
    workers: int = 0
    labels: dict[str, Tensor] | None = None

    def __attrs_post_init__(self) -> None:
        if self.event_shape is None:
            first = self.train[0]
            object.__setattr__(self, "event_shape", tuple(first.shape))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.event_shape

    @property
    def dim(self) -> int:
        """d: numbers per example (the flattened event shape)."""
        return math.prod(self.event_shape)

    @property
    def image_shape(self) -> tuple[int, int, int] | None:
        """(C, H, W) when the examples are images, else None."""
        return self.event_shape if len(self.event_shape) == 3 else None

    def has(self, split: str) -> bool:
        return getattr(self, split, None) is not None

    def size(self, split: str = "train") -> int:
        return len(getattr(self, split))

    def tensor(self, split: str = "test", n: int | None = None) -> Tensor:
        """The first ``n`` (default all) examples of a split, prepared: (n, *event_shape) floats.

        In-memory splits stay on their device; examples read from a Dataset are stacked on the CPU.
        """
        store = getattr(self, split)
        if store is None:
            raise ValueError(f"the data set has no '{split}' split")
        n = len(store) if n is None else min(n, len(store))
        raw = store[:n] if isinstance(store, Tensor) else torch.stack([store[i] for i in range(n)])
        return self.prepare(raw) if self.prepare is not None else raw

    def take(self, split: str, indices: Tensor) -> Tensor:
        """The examples ``indices`` (k,) of a split, prepared: (k, *event_shape), on the split's device."""
        store = getattr(self, split)
        if isinstance(store, Tensor):
            raw = store[indices.to(store.device)]
        else:
            raw = torch.stack([store[int(i)] for i in indices.tolist()])
        return self.prepare(raw) if self.prepare is not None else raw

    @classmethod
    def stand_in(
        cls, event_shape: tuple[int, ...], bounds: tuple[float, float] = (0.0, 1.0), n: int = 64
    ) -> DataSplits:
        """Uniform noise of the right shape inside ``bounds``, with class labels 0-9: what a data set
        returns to ``validate`` (``parts.dry_run``) when its files are absent, so the rest of the
        recipe can be checked."""
        g = torch.Generator().manual_seed(0)
        lo, hi = bounds
        x = lo + (hi - lo) * torch.rand(n, *event_shape, generator=g)
        y = torch.arange(n) % 10
        labels = {"train": y, "test": y[: n // 2], "val": y[n // 2 :]}
        return cls(train=x, test=x[: n // 2], val=x[n // 2 :], bounds=(bounds,) * math.prod(event_shape), labels=labels)


@attrs.frozen
class EvalResult:
    """What an evaluator returns: named scalars and named images (C, H, W) float in [0, 1]."""

    scalars: dict[str, float] = attrs.field(factory=dict)
    images: dict[str, Tensor] = attrs.field(factory=dict)

    @classmethod
    def mean_over_points(cls, name: str, values: Tensor) -> EvalResult:
        """Scalars ``name`` (mean of per-point values (n,)) and ``name_stderr`` (std/√n; NaN for n = 1)."""
        n = len(values)
        stderr = float(values.std() / math.sqrt(n)) if n > 1 else float("nan")
        return cls(scalars={name: float(values.mean()), f"{name}_stderr": stderr})


class Evaluator:
    """Evaluates the run's live parts: ``evaluator(parts) -> EvalResult`` (model, posterior, data,
    device...). An evaluator factory returns an instance of a subclass, or a plain function made
    one by ``evaluator``; a function returned as it is works too, without what this class declares.

    ``reports`` are the scalar keys it returns with the options it was built with (None: those its
    registration declares); ``validate`` checks ``[run] select_metric`` against them. ``announce``
    is a line printed before it starts, for an evaluation that takes long."""

    reports: tuple[str, ...] | None = None
    announce: str | None = None

    def __call__(self, parts: Any) -> EvalResult:
        raise NotImplementedError


class FunctionEvaluator(Evaluator):
    """A function ``parts -> EvalResult`` as an ``Evaluator`` (``evaluator``)."""

    def __init__(self, fn: Callable[[Any], EvalResult], reports: Iterable[str] | None, announce: str | None):
        self.fn, self.announce = fn, announce
        self.reports = None if reports is None else tuple(reports)
        self.__doc__ = fn.__doc__

    def __call__(self, parts: Any) -> EvalResult:
        return self.fn(parts)


def evaluator(
    fn: Callable[[Any], EvalResult], *, reports: Iterable[str] | None = None, announce: str | None = None
) -> Evaluator:
    """The function ``fn`` (parts -> EvalResult) as an ``Evaluator`` that returns the scalar keys
    ``reports`` and prints ``announce`` before it starts."""
    return FunctionEvaluator(fn, reports, announce)


def reporting(keys: Iterable[str]) -> Callable[[Callable[[Any], EvalResult]], Evaluator]:
    """Decorator for an evaluate function: the ``Evaluator`` that returns the scalar keys ``keys``."""
    return lambda fn: evaluator(fn, reports=keys)


@contextlib.contextmanager
def evaluation_mode(networks: Iterable[nn.Module]) -> Iterator[None]:
    """Within the block every network is in eval mode (batch norm reads its running statistics,
    spectral norm skips its power iteration); afterwards each gets its mode and every buffer back,
    so an evaluation leaves the training where it found it, whatever the evaluator switched or wrote."""
    networks = list(networks)
    modes = [{name: m.training for name, m in net.named_modules()} for net in networks]
    buffers = [[b.detach().clone() for b in net.buffers()] for net in networks]
    for net in networks:
        net.eval()
    try:
        yield
    finally:
        for net, net_modes, kept in zip(networks, modes, buffers):
            for name, m in net.named_modules():
                m.training = net_modes[name]
            with torch.no_grad():
                for b, value in zip(net.buffers(), kept):
                    b.copy_(value)


class Schedule:
    """A learning-rate schedule: the rate of a role's optimizer before each training step.
    ``constant`` marks one that never changes the rate (a captured CUDA graph then reads a plain
    number; a changing rate is written into a device tensor the captured step reads)."""

    constant: bool = False

    def lr(self, base_lr: float, step: int, total_steps: int, steps_per_epoch: int) -> float:
        """The learning rate at training step ``step`` (0-based) of ``total_steps``."""
        raise NotImplementedError


@attrs.frozen
class Draw:
    """Samples (n, *event_shape) and the sampler's diagnostics of the chains that drew them, named
    scalars such as ``acceptance``, ``ess_energy`` and ``rhat_energy`` (empty when it has none)."""

    samples: Tensor
    diagnostics: dict[str, float] = attrs.field(factory=dict)


class Sampler:
    """Draws samples of v from a model. A sampler that reports diagnostics (acceptance rates,
    effective sample sizes, R-hat) overrides ``draw``, and ``sample`` returns its samples."""

    def sample(self, model: EnergyModel, n: int, generator: torch.Generator | None = None) -> Tensor:
        """n samples (n, *event_shape)."""
        raise NotImplementedError

    def draw(self, model: EnergyModel, n: int, generator: torch.Generator | None = None) -> Draw:
        """n samples (n, *event_shape), the same as ``sample`` gives for the same generator state,
        with the diagnostics of the chains that drew them; by default none."""
        return Draw(self.sample(model, n, generator))

    def diagnostics_keys(self, model: EnergyModel, n: int) -> tuple[str, ...]:
        """The keys of the diagnostics ``draw(model, n)`` returns, known before it runs (an evaluator
        that reports them declares them); none by default."""
        return ()


class Logger:
    """A sink for metrics and images. Steps are optimizer steps."""

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        """Record scalars at ``step``."""

    def log_images(self, step: int, images: dict[str, Tensor]) -> None:
        """Record images (C, H, W) in [0, 1] at ``step``."""

    def log_evaluation(self, step: int, scalars: dict[str, float], checkpoint: str) -> None:
        """Record what ``eblvm eval`` found on ``checkpoint`` ("last", "best", "step:N" or a file),
        whose step is ``step``; by default as scalars at ``step``. A logger that keeps a row per
        checkpoint (the CSV table) tells them apart by ``checkpoint``, as metrics.jsonl does."""
        self.log_scalars(step, scalars)

    def resume(self, step: int) -> None:
        """The run continues from its checkpoint at ``step``: drop (or hide) what an earlier session
        recorded after it, which the resumed run records again."""

    def log_hparams(self, hparams: dict[str, float | int | str | bool], metrics: dict[str, float]) -> None:
        """Record the run's hyper-parameters (the resolved recipe, flattened: ``"model.n_hidden": 4``)
        with its final evaluation, once the run has finished."""

    def close(self) -> None:
        """Flush and release resources."""


class Parts:
    """The live parts of a run, built in the order of ``eblvm_core.registry.KINDS``: data, model,
    posterior, generator, objective, divergence, sampler, then the estimator.

    The part of recipe section ``[name]`` is ``parts.name`` (None when the recipe has no such
    section); a factory sees those built before it. ``parts.need(name, section)`` returns one or
    raises the ConfigError that names the section that needed it. ``role_factories`` maps a role
    to a factory params -> TrainingRole (the builder makes one per ``[optim.<role>]``); parts built
    by hand may give ``optimizer_factories`` (params -> torch optimizer) instead; ``roles`` holds
    the roles made so far by ``make_role``. ``roles_from_recipe`` (the builder's) makes a role
    without a factory an error the builder reports. ``registries`` are those the run is built
    from; ``batch_size`` is [run] batch_size, the global batch. ``dry_run`` is true while ``eblvm
    validate`` builds the recipe (no training: a data set whose files are absent may return
    ``DataSplits.stand_in`` after ``warn``-ing).
    """

    def __init__(
        self,
        device: torch.device = torch.device("cpu"),
        dtype: torch.dtype = torch.float32,
        role_factories: dict[str, Callable[..., TrainingRole]] | None = None,
        optimizer_factories: dict[str, Callable[..., torch.optim.Optimizer]] | None = None,
        run_dir: Any = None,
        dry_run: bool = False,
        *,
        registries: Mapping[str, Registry] | None = None,
        batch_size: int | None = None,
        roles_from_recipe: bool = False,
        warnings: list[str] | None = None,
        **components: Any,
    ):
        unknown = set(components) - set(SECTION_KINDS)
        if unknown:
            raise TypeError(f"Parts has no section {sorted(unknown)}; sections: {sorted(SECTION_KINDS)}")
        self.device, self.dtype, self.run_dir, self.dry_run = device, dtype, run_dir, dry_run
        self.role_factories = dict(role_factories or {})
        self.optimizer_factories = dict(optimizer_factories or {})
        self.registries = registries
        self.batch_size = batch_size
        self.roles_from_recipe = roles_from_recipe
        self.roles: dict[str, TrainingRole] = {}
        self.missing_roles: list[str] = []
        self.warnings: list[str] = [] if warnings is None else warnings
        self.components: dict[str, Any] = dict(components)

    def __getattr__(self, name: str) -> Any:
        if name in SECTION_KINDS:
            return self.__dict__.get("components", {}).get(name)
        raise AttributeError(f"Parts has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in SECTION_KINDS:
            self.components[name] = value
        else:
            object.__setattr__(self, name, value)

    def evolve(self, *, roles_from_recipe: bool | None = None, **changes: Any) -> Parts:
        """A shallow copy with some parts replaced (e.g. a private copy of the posterior), whose
        ``make_role`` makes roles of its own (from the same factories; ``roles_from_recipe=False``:
        Adam at 1e-3 for a role without one)."""
        other = copy.copy(self)
        object.__setattr__(other, "components", {**self.components})
        object.__setattr__(other, "roles", {})
        object.__setattr__(other, "missing_roles", [])
        if roles_from_recipe is not None:
            object.__setattr__(other, "roles_from_recipe", roles_from_recipe)
        for name, value in changes.items():
            setattr(other, name, value)
        return other

    def networks(self) -> dict[str, nn.Module]:
        """The trainable networks by section (model, posterior, generator...): what checkpoints hold."""
        return {name: part for name, part in self.components.items() if isinstance(part, nn.Module)}

    def make_role(self, role: str, params: Any) -> TrainingRole:
        """The ``TrainingRole`` of recipe section [optim.<role>] over ``params``; ``roles[role]``
        holds the last one made.

        A role with neither factory gets Adam at 1e-3: outside a recipe (parts built by hand) that
        is the default; in a recipe (``roles_from_recipe``) the builder then reports the missing section.
        """
        if role in self.role_factories:
            made = self.role_factories[role](params)
        else:
            if self.roles_from_recipe:
                self.missing_roles.append(role)
            make_optimizer = self.optimizer_factories.get(role, lambda p: torch.optim.Adam(p, lr=1e-3))
            made = TrainingRole(role, make_optimizer(params))
        self.roles[role] = made
        return made

    def registry(self, kind: str) -> Registry:
        """The registry of ``kind`` ("samplers", "datasets", ...) the run is built from, for a
        component that builds another registered component by name (a sample grid's sampler);
        parts built by hand get the installed plugins'."""
        if self.registries is None:
            from eblvm_core.plugins import load

            self.registries = load().registries
        return self.registries[kind]

    def need(self, name: str, section: str, key: str = "kind") -> Any:
        """The part ``name`` or a ConfigError naming the section that needed it."""
        from eblvm_core.errors import ConfigError

        value = getattr(self, name)
        if value is None:
            raise ConfigError(section, key, f"this component needs a [{name}] section")
        return value

    def warn(self, message: str) -> None:
        """Note something the user should know that is not an error (``validate`` prints it)."""
        self.warnings.append(message)
