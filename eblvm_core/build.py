"""Recipe -> live parts: data, model, posterior, objective, divergence, optimizers, estimator,
evaluators and loggers."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import attrs
import torch

from eblvm_core.contracts import EvalResult, Logger, Parts
from eblvm_core.errors import ConfigError
from eblvm_core.recipe import Recipe, Section


@attrs.define
class Built:
    parts: Parts
    evaluators: list[tuple[str, Callable[[Parts], EvalResult]]]
    loggers: list[Logger]


def pick_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("run", "device", "cuda requested but no CUDA device is available")
    return torch.device(choice)


def _make(section: Section, *args: Any) -> Any:
    try:
        return section.entry.factory(section.config, *args)
    except ConfigError as exc:
        exc.section = exc.section or section.label
        raise


def build(recipe: Recipe, device: torch.device, run_dir: Path | None = None) -> Built:
    """Build every part of the recipe in order; ConfigErrors carry the recipe's file name."""
    dtype = getattr(torch, recipe.run.dtype)
    parts = Parts(device=device, dtype=dtype, run_dir=run_dir)
    try:
        data = _make(recipe.parts["data"], parts)
        parts.data = attrs.evolve(
            data,
            train=data.train.to(device, dtype),
            test=data.test.to(device, dtype),
            val=None if data.val is None else data.val.to(device, dtype),
        )
        parts.model = _make(recipe.parts["model"], parts).to(device, dtype)
        if "posterior" in recipe.parts:
            parts.posterior = _make(recipe.parts["posterior"], parts).to(device, dtype)
        if "objective" in recipe.parts:
            parts.objective = _make(recipe.parts["objective"], parts)
        if "divergence" in recipe.parts:
            parts.divergence = _make(recipe.parts["divergence"], parts)
        if "sampler" in recipe.parts:
            parts.samplers["default"] = _make(recipe.parts["sampler"], parts)
        for name, section in recipe.optim.items():
            parts.optimizer_factories[name] = lambda params, _s=section: _make(_s, params)
        parts.estimator = _make(recipe.parts["estimator"], parts)
        evaluators = [(s.kind, _make(s, parts)) for s in recipe.evals]
        loggers: list[Logger] = []
        if run_dir is not None:
            loggers = [_make(s, run_dir) for s in recipe.logs]
    except ConfigError as exc:
        exc.file = exc.file or recipe.path
        raise
    return Built(parts, evaluators, loggers)
