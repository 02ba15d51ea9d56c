"""What a plugin imports to offer components: the contracts they implement, the option helpers of
their config classes, the errors they raise, the hook marker, and what a plugin command or
launcher needs. The hooks themselves, each with what its factories return, are in
``eblvm_core.hookspecs``; the shared tools (bi-level steps, collectives, images, figures) are in
``eblvm.tools``. Anything else in eblvm may change without breaking a plugin.

    >>> import attrs
    >>> from eblvm.plugin import ConfigError, option, positive, structure
    >>> @attrs.frozen
    ... class MyConfig:
    ...     alpha: float = option(0.5, "order of the divergence", positive)
    >>> structure(MyConfig, {"alpha": 2}, "divergence")  # a recipe's [divergence] values, checked
    MyConfig(alpha=2.0)
    >>> try:
    ...     structure(MyConfig, {"alpha": -1, "beta": 1}, "divergence")
    ... except ConfigError as refused:  # every bad key at once, one line each
    ...     print(refused)
    [divergence] alpha: must be > 0, got -1.0
    [divergence] beta: unknown key; valid keys: alpha
"""

from __future__ import annotations

from eblvm_core.cli_support import check_device, fail, guarded
from eblvm_core.config import in_range, non_negative, option, positive, structure
from eblvm_core.contracts import (
    Conditioned,
    DataSplits,
    Divergence,
    Draw,
    EnergyModel,
    Estimator,
    EvalResult,
    Evaluator,
    LatentSpec,
    Logger,
    Parts,
    Posterior,
    Sampler,
    Schedule,
    ScoreField,
    ScoreObjective,
    energies,
    evaluator,
    exact_score,
    reporting,
)
from eblvm_core.errors import ConfigError, DataError, EblvmError, Interrupted, TrainingDiverged
from eblvm_core.hookspecs import hookimpl
from eblvm_core.launching import RUN_DIR_FILE, Launcher, RunRequest, describe_options, launcher_options
from eblvm_core.registry import NoConfig, Registry
from eblvm_core.roles import TrainingRole

__all__ = [
    # contracts
    "Conditioned",
    "DataSplits",
    "Divergence",
    "Draw",
    "EnergyModel",
    "Estimator",
    "EvalResult",
    "Evaluator",
    "LatentSpec",
    "Logger",
    "Parts",
    "Posterior",
    "Sampler",
    "Schedule",
    "ScoreField",
    "ScoreObjective",
    "TrainingRole",
    "energies",
    "evaluator",
    "exact_score",
    "reporting",
    # config classes, registries, errors, the hook marker
    "NoConfig",
    "Registry",
    "in_range",
    "non_negative",
    "option",
    "positive",
    "structure",
    "ConfigError",
    "DataError",
    "EblvmError",
    "Interrupted",
    "TrainingDiverged",
    "hookimpl",
    # commands and launchers
    "Launcher",
    "RunRequest",
    "RUN_DIR_FILE",
    "check_device",
    "fail",
    "guarded",
    "describe_options",
    "launcher_options",
]
