"""The tools eblvm's plugins share, for any plugin: parameters as dicts and differentiable optimizer
steps, Hessian-vector products and linear solvers (bi-level estimators), MCMC transitions (MALA,
HMC), step-size adaptation and chain diagnostics (ESS, split R-hat), the collectives of several
processes, a pool of run workers that start quickly (``worker_pool``; ``pause_gc``, a pool's
initializer of one's own), image pipelines, figures, and the names of a run directory's files.
The contracts are in ``eblvm.plugin``.

    >>> import torch
    >>> from eblvm.tools import apply_override, did_you_mean, hvp
    >>> x = torch.tensor([1.0, 2.0], requires_grad=True)
    >>> (grad,) = torch.autograd.grad((x**3).sum(), [x], create_graph=True)
    >>> hvp([grad], [x], [torch.ones(2)])  # the Hessian diag(6x) times (1, 1)
    [tensor([ 6., 12.])]
    >>> raw = {"run": {"steps": 10}, "eval": [{"kind": "exact-loglik"}]}
    >>> apply_override(raw, "eval.1.kind=density-plot")  # a -o value; an index at the end appends
    >>> [table["kind"] for table in raw["eval"]]
    ['exact-loglik', 'density-plot']
    >>> did_you_mean("stepz", ["steps", "seed"])
    " (did you mean 'steps'?)"
"""

from __future__ import annotations

from eblvm_core.bilevel import (
    REPEATED,
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
from eblvm_core.contracts import evaluation_mode
from eblvm_core.data import ImageOptions, image_pipeline
from eblvm_core.distributed import active as collectives_active
from eblvm_core.distributed import mean_over_ranks, world_size
from eblvm_core.files import output_file, output_folder, reading
from eblvm_core.mcmc import (
    Chains,
    DualAveraging,
    Potential,
    Transition,
    autograd_potential,
    chain_diagnostics,
    chain_diagnostics_keys,
    effective_sample_size,
    hmc_step,
    mala_step,
    split_rhat,
)
from eblvm_core.plot import axes_at, bounds_box, figure, image_grid, render, widest_text
from eblvm_core.plugins import install_hint
from eblvm_core.recipe import apply_override, check_unchanged, set_value, validate_with
from eblvm_core.recipe import read as read_recipe_file
from eblvm_core.recipe.library import names as bundled_recipes
from eblvm_core.recipe.library import recipe_file
from eblvm_core.registry import did_you_mean
from eblvm_core.rundir import METRICS, PROVENANCE, RECIPE, hyperparameters
from eblvm_core.startup import pause_gc, worker_pool

__all__ = [
    # bi-level steps
    "REPEATED",
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
    # Markov chains: MALA and HMC transitions, step-size adaptation, diagnostics
    "Chains",
    "DualAveraging",
    "Potential",
    "Transition",
    "autograd_potential",
    "chain_diagnostics",
    "chain_diagnostics_keys",
    "effective_sample_size",
    "hmc_step",
    "mala_step",
    "split_rhat",
    # several processes
    "collectives_active",
    "mean_over_ranks",
    "world_size",
    "pause_gc",
    "worker_pool",
    # evaluations, images and figures
    "evaluation_mode",
    "ImageOptions",
    "image_pipeline",
    "axes_at",
    "bounds_box",
    "figure",
    "image_grid",
    "render",
    "widest_text",
    # files, packages, names
    "output_file",
    "output_folder",
    "reading",
    "METRICS",
    "PROVENANCE",
    "RECIPE",
    "apply_override",
    "check_unchanged",
    "bundled_recipes",
    "read_recipe_file",
    "recipe_file",
    "set_value",
    "validate_with",
    "did_you_mean",
    "hyperparameters",
    "install_hint",
    "save_atomic",
]
