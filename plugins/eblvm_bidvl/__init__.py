"""BiDVL plugin: bi-level doubly variational learning of a decoupled EBLVM (energy, encoder,
generator), its networks, reconstruction and OOD evaluators, and the generator's sampler."""

from eblvm.plugin import NoConfig, hookimpl
from eblvm_bidvl.estimator import BiDVL, BiDVLConfig, build_bidvl, gaussian_kl
from eblvm_bidvl.evaluators import (
    OODConfig,
    ReconstructionConfig,
    auroc,
    build_generator_sampler,
    build_ood,
    build_reconstruction,
)
from eblvm_bidvl.nets import EnergyConfig, GeneratorConfig, build_energy, build_generator

__all__ = ["BiDVL", "auroc", "gaussian_kl"]


@hookimpl
def register_models(register):
    register("bidvl-energy", build_energy, EnergyConfig)


@hookimpl
def register_generators(register):
    register("bidvl-generator", build_generator, GeneratorConfig)


@hookimpl
def register_estimators(register):
    register("bidvl", build_bidvl, BiDVLConfig)


@hookimpl
def register_evaluators(register):
    register(
        "reconstruction",
        build_reconstruction,
        ReconstructionConfig,
        reports=("{split}_rmse", "{split}_rmse_batch_stats"),
    )
    register("ood-auroc", build_ood, OODConfig, reports=("uniform_auroc",))


@hookimpl
def register_samplers(register):
    register("generator", build_generator_sampler, NoConfig)
