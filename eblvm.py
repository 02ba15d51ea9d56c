"""eblvm from Python (docs/python.md), and ``python -m eblvm``, the command line as a module
(what torchrun launches: ``torchrun --nproc-per-node G -m eblvm run RECIPE``).

    import eblvm

    run = eblvm.train("recipes/grbm_bissm.toml", overrides={"run.steps": 2000})
    run.metrics                       # the final evaluation, as `eblvm run` prints it
    loaded = eblvm.load(run.run_dir)  # model, posterior, sampler, data; evaluate(), sample(n)

``train``, ``load``, ``load_recipe``, ``Run`` and ``LoadedRun`` come from ``eblvm_core.api``,
imported on first use: ``import eblvm`` itself loads neither torch nor a plugin.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from eblvm_core import __version__

if TYPE_CHECKING:
    from eblvm_core.api import LoadedRun, Run, load, load_recipe, train

__all__ = ["LoadedRun", "Run", "__version__", "load", "load_recipe", "train"]
_API = ("LoadedRun", "Run", "load", "load_recipe", "train")


def __getattr__(name: str) -> Any:
    if name in _API:
        from eblvm_core import api

        return getattr(api, name)
    raise AttributeError(f"module 'eblvm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if __name__ == "__main__":
    from eblvm_core.cli import main

    sys.exit(main())
