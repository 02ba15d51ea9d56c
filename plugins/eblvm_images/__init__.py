"""Image data sets: Frey face (the GRBM experiments), MNIST, CIFAR-10, CelebA, SVHN and
scikit-learn's digits (the deep-EBLVM and BiDVL experiments), and folders of image files."""

from eblvm.plugin import hookimpl
from eblvm_images.folder import ImageFolderConfig, image_folder
from eblvm_images.freyface import FreyFaceConfig, freyface
from eblvm_images.standard import (
    CelebAConfig,
    CIFAR10Config,
    DigitsConfig,
    MNISTConfig,
    SVHNConfig,
    celeba,
    cifar10,
    digits,
    mnist,
    svhn,
)

__all__ = ["FreyFaceConfig", "ImageFolderConfig", "freyface", "image_folder"]


@hookimpl
def register_datasets(register):
    register("freyface", freyface, FreyFaceConfig)
    register("image-folder", image_folder, ImageFolderConfig)
    register("digits", digits, DigitsConfig)
    register("mnist", mnist, MNISTConfig)
    register("cifar10", cifar10, CIFAR10Config)
    register("celeba", celeba, CelebAConfig)
    register("svhn", svhn, SVHNConfig)
