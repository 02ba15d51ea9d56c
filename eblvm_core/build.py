"""Recipe -> live parts, in the order of ``registry.KINDS`` (the device settled once the data and
the networks are made); then the roles, the estimator and the evaluators; the loggers once a run
directory exists. Every check that can fail before training
happens here, so ``eblvm validate`` (a dry build) rejects what ``eblvm run`` would."""

from __future__ import annotations

import importlib.util
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from eblvm_core import checkpoint as ckpt
from eblvm_core.context import pick_device
from eblvm_core.contracts import DataSplits, EvalResult, Logger, Parts, Schedule
from eblvm_core.errors import ConfigError, DataError
from eblvm_core.graphs import recipe_graph_refusal
from eblvm_core.plugins import install_hint, load
from eblvm_core.recipe import Recipe, Role, Section, load_recipe
from eblvm_core.registry import Entry, did_you_mean
from eblvm_core.roles import Precision, TrainingRole


@attrs.frozen
class Built:
    """A recipe's live parts on their device: the parts (networks, data, estimator...), the roles
    the estimator trains, the evaluators, the precision of the training steps, and, when
    ``device = "auto"`` chose the CPU over a GPU it found, why (``cpu_because``)."""

    parts: Parts
    roles: dict[str, TrainingRole]
    evaluators: list[tuple[str, Callable[[Parts], EvalResult]]]
    precision: Precision
    cpu_because: str | None = None

    @property
    def device(self) -> torch.device:
        return self.parts.device


# device = "auto" trains on the GPU from this many trainable parameters (all roles together), and
# below it only when the step is replayed from a CUDA graph. Launched kernel by kernel, a small
# model's step is a few hundred tiny launches and one CPU core is faster: on an H100 host
# (docs/benchmarks.md) a 16-parameter checkerboard GRBM steps 2.4x faster on one CPU thread, a
# Frey-face GRBM with 20 hidden units (24,000 parameters with its posterior) 1.1-1.7x, while with
# 400 hidden units (450,000) the GPU is 1.6-2.5x faster; the two cross near 60,000-120,000.
AUTO_GPU_MIN_PARAMETERS = 100_000


def prefers_cpu(networks: dict[str, nn.Module]) -> int | None:
    """The trainable parameter count of ``networks`` when it is below AUTO_GPU_MIN_PARAMETERS (the
    CPU is then faster than a GPU launching the step's kernels one by one), else None."""
    count = sum(p.numel() for net in networks.values() for p in net.parameters() if p.requires_grad)
    return count if count < AUTO_GPU_MIN_PARAMETERS else None


def declared_graph_safe(entry: Entry) -> bool:
    """Whether the estimator an estimator factory returns declares its step graph-safe, read from
    the factory's return annotation (an ``Estimator`` subclass) before anything is built; False
    when the factory does not say what it returns."""
    try:
        returned = typing.get_type_hints(entry.factory).get("return")
    except Exception:  # an annotation that does not resolve: unknown
        return False
    return isinstance(returned, type) and bool(getattr(returned, "graph_safe", False))


def auto_on_cpu(recipe: Recipe, networks: dict[str, nn.Module], precision: Precision) -> str | None:
    """Why ``device = "auto"`` should train this run on the CPU instead of a GPU it found, or None
    to keep the GPU: a small model (``prefers_cpu``) whose step will not be replayed from a CUDA
    graph (``graphs.recipe_graph_refusal``). A replayed step beats one CPU thread at every size
    measured (docs/benchmarks.md). Decided once the networks are made, before anything is placed."""
    count = prefers_cpu(networks)
    if count is None:
        return None
    kinds = {name: role.optimizer.kind for name, role in recipe.optim.items()}
    graph_safe = declared_graph_safe(recipe.parts["estimator"].entry)
    refusal = recipe_graph_refusal(recipe.run.cuda_graph, precision, graph_safe, kinds)
    if refusal is None:
        return None
    return f"{count:,} trainable parameters, too few for the GPU to pay without a CUDA graph ({refusal})"


TOO_LARGE = ("Storage size calculation overflowed", "can't allocate memory", "out of memory", "negative dimension")


def _suspect_key(config: Any) -> str | None:
    """The integer option most likely to be the size that failed: a negative one, else the largest."""
    sizes = []
    for field in attrs.fields(type(config)) if attrs.has(type(config)) else ():
        value = getattr(config, field.name)
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, int) and not isinstance(item, bool):
                sizes.append((item < 0, abs(item), field.name))
    return max(sizes)[2] if sizes else None


def _make(section: Section, *args: Any) -> Any:
    """``factory(config, *args)``; its ConfigErrors and DataErrors name ``section``, and sizes
    that torch cannot allocate (overflowing, negative, beyond memory) are a ConfigError too."""
    try:
        return section.entry.factory(section.config, *args)
    except ConfigError as exc:
        exc.section = exc.section or section.label
        raise
    except DataError as exc:
        raise ConfigError(section.label, exc.key, str(exc)) from None
    except (RuntimeError, MemoryError, OverflowError) as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if isinstance(exc, RuntimeError) and not any(marker in message for marker in TOO_LARGE):
            raise
        raise ConfigError(
            section.label, _suspect_key(section.config), f"cannot be built at this size: {message}"
        ) from None


def _place(data: DataSplits, device: torch.device, dtype: torch.dtype) -> DataSplits:
    """In-memory splits moved to the device; float ones converted to the run's dtype."""

    def move(split: Any) -> Any:
        if not isinstance(split, Tensor):
            return split
        return split.to(device, dtype) if split.is_floating_point() else split.to(device)

    return attrs.evolve(data, train=move(data.train), test=move(data.test), val=move(data.val))


def _role_factory(name: str, role: Role, schedule: Schedule, precision: Precision) -> Callable[[Any], TrainingRole]:
    """params -> the TrainingRole of [optim.<name>]: its optimizer, schedule, clipping (the
    optimizer config's ``max_grad_norm``, where it has one), scaler (fp16) and EMA."""

    def make(params: Any) -> TrainingRole:
        optimizer = _make(role.optimizer, params)
        clip = getattr(role.optimizer.config, "max_grad_norm", None)
        return TrainingRole(name, optimizer, schedule, clip, precision.scaler(), role.ema)

    return make


def _check_roles(recipe: Recipe, estimator: Any, made: dict[str, TrainingRole], missing: list[str]) -> None:
    """The recipe's [optim.<role>] sections are exactly the estimator's roles: unknown ones first
    (a misspelling is both unknown and missing), then missing ones."""
    kind = recipe.parts["estimator"].kind
    roles = tuple(getattr(estimator, "roles", ()))
    if sorted(roles) != sorted(made):
        raise TypeError(f"estimator '{kind}' declares roles {roles} but made {tuple(made)} (parts.make_role)")
    for name in recipe.optim:
        if name not in roles:
            hint = did_you_mean(name, missing) or did_you_mean(name, list(roles))
            raise ConfigError(
                f"optim.{name}", None, f"unknown role{hint}; estimator '{kind}' trains: {', '.join(roles)}"
            )
    for name in missing:
        raise ConfigError(
            f"optim.{name}",
            "kind",
            f"missing: estimator '{kind}' trains role '{name}'; add [optim.{name}] with an optimizer kind",
        )


def _check_precision(recipe: Recipe, estimator: Any) -> None:
    precision = recipe.run.precision
    allowed = tuple(getattr(estimator, "precisions", ("fp32",)))
    if precision not in allowed:
        why = getattr(estimator, "precision_note", "")
        raise ConfigError(
            "run",
            "precision",
            f"estimator '{recipe.parts['estimator'].kind}' supports {', '.join(allowed)}, "
            f"not {precision}" + (f" ({why})" if why else ""),
        )


def _check_select_metric(recipe: Recipe, evaluators: list[tuple[str, Any]]) -> None:
    metric = recipe.run.select_metric
    if metric is None:
        return
    keys: set[str] = set()
    for name, evaluator in evaluators:
        reports = getattr(evaluator, "reports", None)
        if reports is None:
            return  # an evaluator that does not declare its keys: checked when it first reports
        keys.update(f"eval/{name}/{key}" for key in reports)
    if metric not in keys:
        hint = did_you_mean(metric, sorted(keys))
        raise ConfigError(
            "run",
            "select_metric",
            f"no evaluator reports '{metric}'{hint}; reported: {', '.join(sorted(keys)) or 'nothing'}",
        )


NETWORKS_AND_DATA = ("data", "model", "posterior", "generator")  # the sections made before the device is settled


def build(
    recipe: Recipe, device: torch.device, run_dir: Path | None = None, dry_run: bool = False, auto: bool = False
) -> Built:
    """Build every part of the recipe on ``device``; ConfigErrors carry the recipe's file name.

    The data and the networks are made first, then placed on the device; with ``auto`` (``[run]
    device = "auto"`` in one process) a small model whose step would not be replayed from a CUDA
    graph is placed on the CPU instead of the GPU ``device`` (``Built.cpu_because`` says why). Then
    the other parts, the roles' schedules, the estimator (which makes the roles) and the
    evaluators. ``dry_run`` (``eblvm validate``) builds without training; data sets may stand in
    for absent files (``Parts.warn`` says so).
    """
    dtype = getattr(torch, recipe.run.dtype)
    parts = Parts(device=device, dtype=dtype, run_dir=run_dir, dry_run=dry_run)
    parts.registries = load().registries
    parts.strict_roles = True
    parts.batch_size = recipe.run.batch_size
    cpu_because = None
    try:
        pick_device(recipe.run.device)
        sections = [(label, s) for label, s in recipe.parts.items() if label != "estimator"]
        for label, section in sections:
            if label in NETWORKS_AND_DATA:
                setattr(parts, label, _make(section, parts))
        if auto and device.type == "cuda":
            cpu_because = auto_on_cpu(recipe, parts.networks(), Precision(recipe.run.precision, device.type))
            if cpu_because is not None:
                parts.device = device = torch.device("cpu")
        for label, section in sections:
            part = getattr(parts, label) if label in NETWORKS_AND_DATA else _make(section, parts)
            if isinstance(part, DataSplits):
                part = _place(part, device, dtype)
            elif isinstance(part, nn.Module):
                part = part.to(device, dtype)
            setattr(parts, label, part)
        precision = Precision(recipe.run.precision, device.type)
        for name, role in recipe.optim.items():
            parts.role_factories[name] = _role_factory(name, role, _make(role.schedule, parts), precision)
        estimator = _make(recipe.parts["estimator"], parts)
        _check_roles(recipe, estimator, parts.roles, parts.missing_roles)
        _check_precision(recipe, estimator)
        parts.estimator = estimator
        evaluators = [(s.kind, _make(s, parts)) for s in recipe.evals]
        _check_select_metric(recipe, evaluators)
    except ConfigError as exc:
        recipe.blame(exc)
        raise
    return Built(parts, dict(parts.roles), evaluators, precision, cpu_because)


def check_loggers(recipe: Recipe) -> None:
    """Refuse, before any work, a [[log]] whose logger needs a package that is not installed: its
    factory names the module in ``requires`` and says how to install it, by the eblvm extra
    that holds it (``extra = "wandb"``: ``plugins.install_hint``) or a command (``install``),
    looked up without importing it. Called by ``validate`` and ``run``, not by ``eval``/``sample``,
    which build no loggers."""
    for section in recipe.logs:
        factory = section.entry.factory
        requires = getattr(factory, "requires", None)
        if requires and importlib.util.find_spec(requires) is None:
            extra = getattr(factory, "extra", None)
            install = install_hint(extra) if extra else getattr(factory, "install", f"pip install {requires}")
            error = ConfigError(
                section.label, "kind", f"the {section.kind} logger needs the {requires} package: {install}"
            )
            recipe.blame(error)
            raise error


def build_loggers(recipe: Recipe, run_dir: Path) -> list[Logger]:
    """The recipe's [[log]] sinks, writing into ``run_dir`` (made once the run directory exists)."""
    try:
        return [_make(s, run_dir) for s in recipe.logs]
    except ConfigError as exc:
        exc.file = exc.file or recipe.path
        raise


def dry_run(recipe: Recipe | str | Path, overrides: list[str] = (), check_data: bool = False) -> list[str]:
    """``eblvm validate`` of one recipe (a ``Recipe``, or a file with ``overrides``): build it on the
    CPU without training or writing; returns the warnings. Raises what ``run`` would raise before
    its first step. Without ``check_data`` data sets may stand in for absent files."""
    if not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe, overrides)
    check_loggers(recipe)
    with torch.random.fork_rng(devices=[]):
        ckpt.seed_everything(recipe.run.seed or 0)
        built = build(recipe, torch.device("cpu"), dry_run=not check_data)
    return list(dict.fromkeys(built.parts.warnings))
