"""Image data sets: Frey face (the BiSM paper's GRBM experiments)."""

from eblvm_core.hookspecs import hookimpl

from eblvm_images.freyface import FreyFaceConfig, freyface

__all__ = ["FreyFaceConfig", "freyface"]


@hookimpl
def register_datasets(register):
    register("freyface", freyface, FreyFaceConfig)
