"""eblvm from Python (docs/python.md).

    >>> import eblvm
    >>> run = eblvm.train("grbm_bissm", overrides={"run.steps": 10}, echo=None)  # in ./runs
    >>> sorted(run.metrics)[:2]  # the final evaluation, as `eblvm run` prints it
    ['eval/density-plot/grid_mass', 'eval/exact-loglik/test_loglik']
    >>> loaded = eblvm.load(run.run_dir, echo=None)  # model, posterior, sampler, data
    >>> loaded.sample(5).shape  # five draws of the trained model's sampler: v is 2-D
    torch.Size([5, 2])

Users import ``eblvm``; plugin authors ``eblvm.plugin`` (the contracts a component implements)
and ``eblvm.tools`` (the shared tools: bi-level steps, collectives, image pipelines, figures).
``train``, ``load``, ``load_recipe``, ``prepare``, ``add_plugin``, ``Run``, ``LoadedRun``, ``Prepared``
and ``Stop`` are imported on first use: ``import eblvm`` itself loads neither torch nor a plugin.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from eblvm_core import __version__

if TYPE_CHECKING:
    from eblvm.api import LoadedRun, Prepared, Run, Stop, add_plugin, load, load_recipe, prepare, train

__all__ = [
    "LoadedRun",
    "Prepared",
    "Run",
    "Stop",
    "__version__",
    "add_plugin",
    "load",
    "load_recipe",
    "prepare",
    "train",
]
_API = ("LoadedRun", "Prepared", "Run", "Stop", "add_plugin", "load", "load_recipe", "prepare", "train")


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module("eblvm.api"), name)
    if name in ("plugin", "tools"):
        return importlib.import_module(f"eblvm.{name}")
    raise AttributeError(f"module 'eblvm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
