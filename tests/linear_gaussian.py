from eblvm_core.testing import LinearGaussianEBLVM, linear_gaussian_parts as build  # noqa: F401  (moved to eblvm_core.testing)
