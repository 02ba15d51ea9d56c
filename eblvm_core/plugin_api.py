"""The plugin interface's former home, kept for one release: import ``eblvm.plugin`` (contracts)
and ``eblvm.tools`` (shared tools) instead. Every name it held is still here."""

from __future__ import annotations

import warnings

from eblvm.plugin import *  # noqa: F403
from eblvm.plugin import __all__ as _contracts
from eblvm.tools import *  # noqa: F403
from eblvm.tools import __all__ as _tools

__all__ = [*_contracts, *_tools]

warnings.warn(
    "eblvm_core.plugin_api is deprecated and goes in the next release: import eblvm.plugin (contracts) "
    "and eblvm.tools (shared tools) instead",
    DeprecationWarning,
    stacklevel=2,
)
