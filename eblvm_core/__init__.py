"""eblvm core: contracts, registries, plugin manager, recipes, the plan, the training loop and the CLI."""

from importlib.metadata import PackageNotFoundError, version

try:  # the installed distribution's version, which setuptools-scm took from the git tag at install
    __version__ = version("eblvm")
except PackageNotFoundError:  # the files on the path without an install
    __version__ = "0.0.0+unknown"
