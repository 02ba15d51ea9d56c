"""NCE plugin: noise-contrastive estimation (``nce``) and variational NCE (``vnce``)."""

from eblvm.plugin import hookimpl
from eblvm_nce.estimators import NCE, VNCE, NCEConfig, VNCEConfig, build_nce, build_vnce, nce_loss

__all__ = ["NCE", "VNCE", "NCEConfig", "VNCEConfig", "nce_loss"]


@hookimpl
def register_estimators(register):
    register("nce", build_nce, NCEConfig)
    register("vnce", build_vnce, VNCEConfig)
