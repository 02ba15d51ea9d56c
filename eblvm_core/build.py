"""Recipe -> live parts, in the order of ``registry.KINDS``: the data and the networks are made on
the CPU, the plan is made from them (``plan.make_plan``), everything is placed on the plan's
device, and the other parts, the roles, the estimator and the evaluators follow; the loggers are
made once a run directory exists. Every check that can fail before training happens here, so
``eblvm validate`` (a dry build) rejects what ``eblvm run`` would, and each factory's result is
checked against its kind's contract."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from eblvm_core import checkpoint as ckpt
from eblvm_core.contracts import (
    DataSplits,
    Divergence,
    EnergyModel,
    Estimator,
    Logger,
    Parts,
    Posterior,
    Sampler,
    Schedule,
    ScoreObjective,
)
from eblvm_core.errors import ConfigError, DataError
from eblvm_core.launching import Launcher
from eblvm_core.plan import Launch, Machine, Plan, Sizes, make_plan
from eblvm_core.plugins import install_hint, load
from eblvm_core.recipe import Recipe, Role, Section, load_recipe, with_run
from eblvm_core.registry import did_you_mean
from eblvm_core.roles import Precision, TrainingRole
from eblvm_core.startup import resume_gc


@attrs.frozen
class Built:
    """A recipe's live parts on their device as the plan placed them: the parts (networks, data,
    estimator...), the roles the estimator trains and the evaluators."""

    plan: Plan
    parts: Parts
    roles: dict[str, TrainingRole]
    evaluators: list[tuple[str, Callable[[Parts], Any]]]

    @property
    def device(self) -> torch.device:
        return self.plan.device


# What each kind's factory must return (a type, or ``callable`` for an evaluator, which may be a function).
CONTRACTS: dict[str, Any] = {
    "datasets": DataSplits,
    "models": EnergyModel,
    "posteriors": Posterior,
    "generators": nn.Module,
    "objectives": ScoreObjective,
    "divergences": Divergence,
    "samplers": Sampler,
    "estimators": Estimator,
    "evaluators": callable,
    "loggers": Logger,
    "optimizers": torch.optim.Optimizer,
    "schedules": Schedule,
    "launchers": Launcher,
}

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


def _checked(section: Section, made: Any) -> Any:
    """``made`` if it is what its kind's factories return, else a ConfigError naming the plugin and the factory."""
    contract = CONTRACTS[section.entry.of_kind]
    if contract(made) if contract is callable else isinstance(made, contract):
        return made
    entry = section.entry
    name = "callable (an Evaluator)" if contract is callable else contract.__name__
    wanted = f"{'an' if name[0] in 'AEIOUaeiou' else 'a'} {name}"
    raise ConfigError(
        section.label,
        "kind",
        f"'{entry.name}' of plugin '{entry.plugin}': its factory {getattr(entry.factory, '__qualname__', entry.factory)} "
        f"returned a {type(made).__name__}, not {wanted}",
    )


def _make(section: Section, *args: Any) -> Any:
    """``factory(config, *args)``, checked against its kind's contract; its ConfigErrors and
    DataErrors name ``section``, and sizes that torch cannot allocate (overflowing, negative,
    beyond memory) are a ConfigError too."""
    try:
        made = section.entry.factory(section.config, *args)
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
    return _checked(section, made)


def _place(part: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """A network moved to the device and dtype; in-memory data splits moved, float ones converted."""
    if isinstance(part, nn.Module):
        return part.to(device, dtype)
    if not isinstance(part, DataSplits):
        return part

    def move(split: Any) -> Any:
        if not isinstance(split, Tensor):
            return split
        return split.to(device, dtype) if split.is_floating_point() else split.to(device)

    return attrs.evolve(part, train=move(part.train), test=move(part.test), val=move(part.val))


def _role_factory(name: str, role: Role, schedule: Schedule, precision: Precision) -> Callable[[Any], TrainingRole]:
    """params -> the TrainingRole of [optim.<name>]: its optimizer, schedule, clipping (the
    optimizer config's ``max_grad_norm``, where it has one), scaler (fp16) and EMA."""

    def make(params: Any) -> TrainingRole:
        optimizer = _make(role.optimizer, params)
        clip = attrs.asdict(role.optimizer.config, recurse=False).get("max_grad_norm")  # an option, where it has one
        return TrainingRole(name, optimizer, schedule, clip, precision.scaler(), role.ema)

    return make


def _check_roles(recipe: Recipe, estimator: Estimator, made: dict[str, TrainingRole], missing: list[str]) -> None:
    """The recipe's [optim.<role>] sections are exactly the estimator's roles: unknown ones first
    (a misspelling is both unknown and missing), then missing ones."""
    kind = recipe.parts["estimator"].kind
    roles = tuple(estimator.roles)
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


def _check_precision(recipe: Recipe, estimator: Estimator) -> None:
    precision = recipe.run.precision
    if precision not in estimator.precisions:
        why = f" ({estimator.precision_note})" if estimator.precision_note else ""
        raise ConfigError(
            "run",
            "precision",
            f"estimator '{recipe.parts['estimator'].kind}' supports {', '.join(estimator.precisions)}, "
            f"not {precision}{why}",
        )


def _check_select_metric(recipe: Recipe, evaluators: list[tuple[str, Any]]) -> None:
    metric = recipe.run.select_metric
    keys = recipe.reported_keys(evaluators) if metric is not None else None
    if metric is None or keys is None or metric in keys:
        return
    hint = did_you_mean(metric, sorted(keys))
    raise ConfigError(
        "run",
        "select_metric",
        f"no evaluator reports '{metric}'{hint}; reported: {', '.join(sorted(keys)) or 'nothing'}",
    )


NETWORKS_AND_DATA = ("data", "model", "posterior", "generator")  # the sections made before the plan


def _early(recipe: Recipe, dry_run: bool) -> Parts:
    """The data and the networks ([data], [model], [posterior], [generator]), made on the CPU: the
    first parts any build makes, so the collector a command's start paused is resumed here."""
    resume_gc()  # eblvm_core.startup: what exists now is frozen, the parts made from here on are not
    early = Parts(dtype=getattr(torch, recipe.run.dtype), **_common(recipe, dry_run))
    for label in NETWORKS_AND_DATA:
        if label in recipe.parts:
            setattr(early, label, _make(recipe.parts[label], early))
    return early


def _common(recipe: Recipe, dry_run: bool) -> dict[str, Any]:
    return {"registries": load().registries, "batch_size": recipe.run.batch_size, "dry_run": dry_run}


def _counted(recipe: Recipe, dry_run: bool) -> tuple[Sizes, Parts]:
    """The data and the networks (``_early``) and the networks' parameter counts; a ConfigError
    names the recipe."""
    try:
        early = _early(recipe, dry_run)
    except ConfigError as exc:
        recipe.blame(exc)
        raise
    return Sizes.of(early.networks()), early


def measure(recipe: Recipe, dry_run: bool = False) -> Sizes:
    """The networks' parameter counts, from the data and the networks made once and thrown away
    (every RNG put back): what the plan's device and thread choices weigh."""
    rng = ckpt.rng_state()
    try:
        return _counted(recipe, dry_run)[0]
    finally:
        ckpt.set_rng_state(rng)


def plan_for(
    recipe: Recipe,
    device: str | None = None,
    launch: Launch = Launch(),
    machine: Machine | None = None,
    dry_run: bool = False,
) -> Plan:
    """The plan of ``recipe`` (``device``, when given, instead of [run] device) on this machine (or
    ``machine``) for a process launched as ``launch`` (``plan.make_plan``)."""
    if device is not None:
        recipe = with_run(recipe, device=str(device))
    return make_plan(recipe, lambda: measure(recipe, dry_run), machine, launch)


def build(
    recipe: Recipe,
    plan: Plan | str | torch.device | None = None,
    *,
    dry_run: bool = False,
    early: Parts | None = None,
) -> Built:
    """Build every part of the recipe as ``plan`` says (or a device such as ``"cpu"``, or None for
    the recipe's: the plan for it on this machine); ConfigErrors carry the recipe's file name.

    The data and the networks are made first, on the CPU, and placed on the plan's device; then
    the roles' schedules, the other parts, the estimator (which makes the roles) and the
    evaluators. ``dry_run`` (``eblvm validate``) builds without training; data sets may stand in
    for absent files (``Parts.warn`` says so). ``early``: the data and networks where they are made
    already, from the random state this call would make them from (``dry_run`` made them to plan).
    """
    if not isinstance(plan, Plan):
        plan = plan_for(recipe, None if plan is None else str(plan), dry_run=dry_run)
    dtype = getattr(torch, recipe.run.dtype)
    try:
        early = early if early is not None else _early(recipe, dry_run)
        schedules = {name: _make(role.schedule, early) for name, role in recipe.optim.items()}
        factories = {
            name: _role_factory(name, role, schedules[name], plan.precision) for name, role in recipe.optim.items()
        }
        placed = {label: _place(part, plan.device, dtype) for label, part in early.components.items()}
        parts = Parts(
            plan.device,
            dtype,
            role_factories=factories,
            roles_from_recipe=True,
            warnings=early.warnings,
            **_common(recipe, dry_run),
            **placed,
        )
        for label, section in recipe.parts.items():
            if label not in NETWORKS_AND_DATA and label != "estimator":
                setattr(parts, label, _place(_make(section, parts), plan.device, dtype))
        estimator = _make(recipe.parts["estimator"], parts)
        _check_roles(recipe, estimator, parts.roles, parts.missing_roles)
        _check_precision(recipe, estimator)
        parts.estimator = estimator
        evaluators = [(s.kind, _make(s, parts)) for s in recipe.evals]
        _check_select_metric(recipe, evaluators)
    except ConfigError as exc:
        recipe.blame(exc)
        raise
    return Built(plan, parts, dict(parts.roles), evaluators)


def check_loggers(recipe: Recipe) -> None:
    """Refuse, before any work, a [[log]] whose logger needs a module that is not installed (its
    registration's ``requires``), saying how to install it: eblvm's extra that holds it
    (``plugins.install_hint``) or the registration's ``install`` command; looked up without
    importing it. Called by ``validate`` and ``run``, not by ``eval``/``sample``, which build no
    loggers."""
    for section in recipe.logs:
        entry = section.entry
        if entry.requires and importlib.util.find_spec(entry.requires) is None:
            install = install_hint(entry.extra) if entry.extra else entry.install or f"pip install {entry.requires}"
            error = ConfigError(
                section.label, "kind", f"the {section.kind} logger needs the {entry.requires} package: {install}"
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


def dry_run(recipe: Recipe | str | Path, overrides: Sequence[str] = (), check_data: bool = False) -> list[str]:
    """``eblvm validate`` of one recipe (a ``Recipe``, or a file with ``overrides``): build it on the
    CPU without training or writing; returns the warnings. Raises what ``run`` would raise before
    its first step. Without ``check_data`` data sets may stand in for absent files."""
    if not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe, overrides)
    check_loggers(recipe)
    stand_in = not check_data
    made: list[Parts] = []  # the data and networks, where the plan weighed them: built once, not twice

    def sizes() -> Sizes:
        counted, early = _counted(recipe, stand_in)
        made.append(early)
        return counted

    with torch.random.fork_rng(devices=[]):
        ckpt.seed_everything(recipe.run.seed or 0)  # planning draws nothing: what sizes() made, build would
        plan = make_plan(recipe, sizes)  # what run would refuse of the device, on this machine
        plan_or_cpu = plan if plan.device.type == "cpu" else "cpu"
        built = build(recipe, plan_or_cpu, dry_run=stand_in, early=made[0] if made else None)
    return list(dict.fromkeys(built.parts.warnings))
