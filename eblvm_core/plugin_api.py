"""Everything a plugin imports from eblvm, in one module: the contracts it implements, the option
helpers of its config classes, the errors it raises, the hook marker, the registries it is handed
(``Parts.registry``), and the shared tools (bi-level steps, collectives, image pipelines, figures,
run-directory names). Plugins import ``eblvm_core.plugin_api`` and nothing else of the core, so the
rest of the core may change without breaking a plugin (``tests/core/test_layers.py`` holds the
bundled plugins to it).

    from eblvm_core.plugin_api import ConfigError, Divergence, Parts, hookimpl, option, positive
"""

from __future__ import annotations

from eblvm_core.bilevel import (
    DifferentiableAdam,
    Functional,
    SolveInfo,
    condition_on,
    conjugate_gradient,
    fit_posterior,
    flat,
    grads_or_zeros,
    hvp,
    neumann,
    sgd_step,
    trainable,
    unflat,
    weighted_mean,
)
from eblvm_core.checkpoint import save_atomic
from eblvm_core.config import in_range, non_negative, option, positive, structure
from eblvm_core.contracts import (
    Conditioned,
    DataSplits,
    Divergence,
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
    evaluation_mode,
    exact_score,
    reporting,
)
from eblvm_core.data import ImageOptions, image_pipeline
from eblvm_core.distributed import active as collectives_active
from eblvm_core.distributed import mean_over_ranks, world_size
from eblvm_core.errors import ConfigError, DataError, EblvmError
from eblvm_core.hookspecs import hookimpl
from eblvm_core.plot import densities, embedding, image_grid, render
from eblvm_core.plugins import install_hint
from eblvm_core.registry import NoConfig, Registry
from eblvm_core.roles import TrainingRole
from eblvm_core.rundir import METRICS, RECIPE, hyperparameters

__all__ = [
    # contracts
    "Conditioned",
    "DataSplits",
    "Divergence",
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
    "evaluation_mode",
    "exact_score",
    "reporting",
    # configs, registries, errors, the hook marker
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
    "hookimpl",
    # bi-level steps
    "DifferentiableAdam",
    "Functional",
    "SolveInfo",
    "condition_on",
    "conjugate_gradient",
    "fit_posterior",
    "flat",
    "grads_or_zeros",
    "hvp",
    "neumann",
    "sgd_step",
    "trainable",
    "unflat",
    "weighted_mean",
    # several processes
    "collectives_active",
    "mean_over_ranks",
    "world_size",
    # images, figures, files
    "ImageOptions",
    "image_pipeline",
    "densities",
    "embedding",
    "image_grid",
    "render",
    "save_atomic",
    "install_hint",
    "METRICS",
    "RECIPE",
    "hyperparameters",
]
