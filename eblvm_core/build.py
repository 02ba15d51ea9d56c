"""Recipe -> live parts, in the order of ``registry.KINDS``; then the optimizers by role, the
estimator, schedules, evaluators and loggers. Every check that can fail before training
happens here, so ``eblvm validate`` (a dry build) rejects what ``eblvm run`` would."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from eblvm_core import checkpoint as ckpt
from eblvm_core.contracts import DataSplits, EvalResult, Logger, Parts, Schedule
from eblvm_core.errors import ConfigError, DataError
from eblvm_core.graphs import graph_refusal
from eblvm_core.plugins import install_hint
from eblvm_core.recipe import Recipe, Role, Section, load_recipe, read, validate
from eblvm_core.registry import did_you_mean
from eblvm_core.spec import is_spec, load_spec


@attrs.define
class Built:
    parts: Parts
    evaluators: list[tuple[str, Callable[[Parts], EvalResult]]]
    loggers: list[Logger]
    schedules: dict[str, Schedule] = attrs.field(factory=dict)


# device = "auto" trains on the GPU from this many trainable parameters (all roles together), and
# below it only when the step is replayed from a CUDA graph. Launched kernel by kernel, a small
# model's step is a few hundred tiny launches and one CPU core is faster: on an H100 host
# (docs/benchmarks.md) a 16-parameter checkerboard GRBM steps 2.4x faster on one CPU thread, a
# Frey-face GRBM with 20 hidden units (24,000 parameters with its posterior) 1.1-1.7x, while with
# 400 hidden units (450,000) the GPU is 1.6-2.5x faster; the two cross near 60,000-120,000.
AUTO_GPU_MIN_PARAMETERS = 100_000


def pick_device(choice: str) -> torch.device:
    """The torch device of ``[run] device``; a ConfigError when it is not available here.
    "auto" gives CUDA when there is one (the trainer then keeps small models whose step cannot
    be graph-replayed on the CPU: ``auto_on_cpu``)."""
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError("run", "device", f"{choice} requested but no CUDA device is available")
        index = int(choice.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ConfigError(
                "run", "device", f"{choice} requested but this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    if choice == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("run", "device", "mps requested but it is not available")
    return torch.device(choice)


def prefers_cpu(parts: Parts) -> int | None:
    """The trainable parameter count when it is below AUTO_GPU_MIN_PARAMETERS (the CPU is then
    faster than a GPU launching the step's kernels one by one), else None."""
    count = sum(p.numel() for net in parts.networks().values() for p in net.parameters() if p.requires_grad)
    return count if count < AUTO_GPU_MIN_PARAMETERS else None


def auto_on_cpu(built: Built, recipe: Recipe, device: torch.device) -> str | None:
    """Why ``device = "auto"`` should train this run on the CPU instead of the GPU it found, or
    None to keep the GPU (``device``): a small model (``prefers_cpu``) whose step cannot be
    replayed from a CUDA graph. A replayed step beats one CPU thread at every size measured
    (docs/benchmarks.md)."""
    count = prefers_cpu(built.parts)
    if count is None:
        return None
    run = recipe.run
    refusal = graph_refusal(built.parts.estimator, built.schedules, device, 1, run.precision, run.cuda_graph)
    if refusal is None:
        return None
    return f"{count:,} trainable parameters, too few for the GPU to pay without a CUDA graph ({refusal})"


SMALL_MODEL = 10_000  # parameters below which one CPU thread is fastest (docs/benchmarks.md)


def set_threads(threads: int, device: torch.device, parts: Parts) -> int:
    """Set torch's CPU threads and return the number in use: ``threads`` when > 0 ([run] threads);
    for 0, one thread on a CPU when the networks hold fewer than SMALL_MODEL parameters (a tiny
    model's steps are many tiny operations, which a second thread only slows: 3-10x on 2 busy
    cores, to the same bits; docs/benchmarks.md), else the current setting."""
    if threads == 0 and device.type == "cpu":
        size = sum(p.numel() for net in parts.networks().values() for p in net.parameters())
        threads = 1 if size < SMALL_MODEL else 0
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


@contextmanager
def subnormals_flushed(device: torch.device) -> Iterator[None]:
    """On a CPU, treat subnormal floats (|x| < 1.2e-38 in float32, 2.2e-308 in float64) as zero
    inside the block, then put torch's default (off) back. A relaxed Bernoulli sample at T = 0.1
    and the unrolled gradients through it are full of them, and x86 CPUs compute with subnormals
    many times slower: BiDSM (K = 1, N = 5) on Frey face took 284 ms per step late in training,
    71 ms flushed (docs/benchmarks.md). Only numbers below the smallest normal one (and their
    products) change: 2,000 steps of the main job end with the same bits."""
    flushed = device.type == "cpu" and torch.set_flush_denormal(True)
    try:
        yield
    finally:
        if flushed:
            torch.set_flush_denormal(False)


@contextmanager
def cudnn_autotuned(device: torch.device, enabled: bool) -> Iterator[None]:
    """On a CUDA device with ``enabled`` ([run] cudnn_benchmark), let cuDNN pick convolution
    algorithms by timing them inside the block, then put the previous setting back."""
    previous = torch.backends.cudnn.benchmark
    if enabled and device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = previous


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


def _optimizer_factory(role: Role, recipe: Recipe, device: torch.device) -> Callable[[Any], torch.optim.Optimizer]:
    def make(params: Any) -> torch.optim.Optimizer:
        optimizer = _make(role.optimizer, params)
        optimizer.base_lrs = [group["lr"] for group in optimizer.param_groups]  # type: ignore[attr-defined]
        if recipe.run.precision == "fp16":
            optimizer.grad_scaler = torch.amp.GradScaler(device.type)  # type: ignore[attr-defined]
        return optimizer

    return make


def _check_roles(recipe: Recipe, estimator: Any, missing: list[str]) -> None:
    """The recipe's [optim.<role>] sections are exactly the estimator's roles: unknown ones first
    (a misspelling is both unknown and missing), then missing ones."""
    kind = recipe.parts["estimator"].kind
    roles = tuple(getattr(estimator, "roles", ()))
    made = tuple(getattr(estimator, "optimizers", {}))
    if sorted(roles) != sorted(made):
        raise TypeError(f"estimator '{kind}' declares roles {roles} but made optimizers for {made}")
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


def build(recipe: Recipe, device: torch.device, run_dir: Path | None = None, dry_run: bool = False) -> Built:
    """Build every part of the recipe but the loggers; ConfigErrors carry the recipe's file name.

    ``dry_run`` (``eblvm validate``) builds without training; data sets may stand in for
    absent files (``Parts.warn`` says so).
    """
    dtype = getattr(torch, recipe.run.dtype)
    parts = Parts(device=device, dtype=dtype, run_dir=run_dir, dry_run=dry_run)
    parts.strict_roles = True
    parts.batch_size = recipe.run.batch_size
    try:
        pick_device(recipe.run.device)
        for label, section in recipe.parts.items():
            if label == "estimator":
                continue
            part = _make(section, parts)
            if isinstance(part, DataSplits):
                part = _place(part, device, dtype)
            elif isinstance(part, nn.Module):
                part = part.to(device, dtype)
            setattr(parts, label, part)
        for name, role in recipe.optim.items():
            parts.optimizer_factories[name] = _optimizer_factory(role, recipe, device)
        estimator = _make(recipe.parts["estimator"], parts)
        _check_roles(recipe, estimator, parts.missing_roles)
        _check_precision(recipe, estimator)
        parts.estimator = estimator
        schedules = {name: _make(role.schedule, parts) for name, role in recipe.optim.items()}
        evaluators = [(s.kind, _make(s, parts)) for s in recipe.evals]
        _check_select_metric(recipe, evaluators)
    except ConfigError as exc:
        recipe.blame(exc)
        raise
    return Built(parts, evaluators, [], schedules)


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


def resolved_recipes(path: str | Path, overrides: list[str] = ()) -> dict[str, Recipe]:
    """The recipe a file resolves to (includes merged, overrides applied, defaults filled in), or
    for a comparison spec each row's, by row name (the file's name for a plain recipe)."""
    raw = read(path)
    if is_spec(raw):
        spec = load_spec(path, overrides)
        return {m.name: validate(spec.recipes[m.name], str(spec.recipe_paths[m.name])) for m in spec.methods}
    return {str(path): load_recipe(path, overrides)}


def dry_run(path: str | Path, overrides: list[str] = (), check_data: bool = False) -> list[str]:
    """``eblvm validate``: build a recipe (or every row of a comparison spec) on the CPU
    without training or writing; returns the warnings. Raises what ``run`` would raise before
    its first step. Without ``check_data`` data sets may stand in for absent files."""
    warnings: list[str] = []
    for recipe in resolved_recipes(path, overrides).values():
        check_loggers(recipe)
        with torch.random.fork_rng(devices=[]):
            ckpt.seed_everything(recipe.run.seed or 0)
            built = build(recipe, torch.device("cpu"), dry_run=not check_data)
        warnings += [w for w in built.parts.warnings if w not in warnings]
    return warnings
