"""Image data sets: Frey face (the BiSM paper's GRBM experiments) and folders of image files."""

from eblvm_core.hookspecs import hookimpl
from eblvm_images.folder import ImageFolderConfig, image_folder
from eblvm_images.freyface import FreyFaceConfig, freyface

__all__ = ["FreyFaceConfig", "ImageFolderConfig", "freyface", "image_folder"]


@hookimpl
def register_datasets(register):
    register("freyface", freyface, FreyFaceConfig)
    register("image-folder", image_folder, ImageFolderConfig)
