"""eblvm core: contracts, registries, plugin manager, recipes, the plan, the training loop and the CLI."""

__version__ = "0.2.0"  # the one place the version is written (pyproject reads it; --version and run.json print it)
