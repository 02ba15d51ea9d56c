"""Deep plugin: the papers' ResNet EBLVM and fully visible EBM on images, and annealed Langevin sampling."""

from eblvm.plugin import hookimpl
from eblvm_deep.langevin import AnnealedLangevin, LangevinConfig, build_langevin, temperatures
from eblvm_deep.models import (
    ResNetConfig,
    ResNetEBLVM,
    ResNetEBLVMConfig,
    ResNetEBM,
    build_resnet_eblvm,
    build_resnet_ebm,
)

__all__ = ["AnnealedLangevin", "ResNetEBLVM", "ResNetEBM", "temperatures"]


@hookimpl
def register_models(register):
    register("resnet-eblvm", build_resnet_eblvm, ResNetEBLVMConfig)
    register("resnet-ebm", build_resnet_ebm, ResNetConfig)


@hookimpl
def register_samplers(register):
    register("annealed-langevin", build_langevin, LangevinConfig, default_for=("resnet-eblvm", "resnet-ebm"))
