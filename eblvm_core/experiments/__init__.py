"""Many runs at once: ``eblvm compare`` (a comparison spec's methods over seeds and a [sweep]
grid, tabulated and drawn), ``eblvm search`` (a hyperparameter search with Optuna), and the
launcher that sends runs to a Slurm cluster through submitit (``--launcher slurm``). The engine (build, session, trainer) never imports this package: its
commands reach the CLI through the ``register_commands`` hook, as a plugin's would, and start runs
through ``session.run``.
"""

from __future__ import annotations

from eblvm_core.hookspecs import hookimpl


@hookimpl
def register_commands(register):
    from eblvm_core.experiments.commands import compare, search

    register(compare)
    register(search)
