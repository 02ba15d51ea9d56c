"""The plugin test kit's former home, kept for one release: import ``eblvm.testing`` instead."""

from __future__ import annotations

import warnings

from eblvm.testing import *  # noqa: F403

warnings.warn(
    "eblvm_core.testing is deprecated and goes in the next release: import eblvm.testing",
    DeprecationWarning,
    stacklevel=2,
)
