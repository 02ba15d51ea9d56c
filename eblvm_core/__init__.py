"""eblvm core: contracts, registries, plugin manager, recipes, trainer and CLI."""

__version__ = "0.1.0"
