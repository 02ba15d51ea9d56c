"""Many runs at once: ``eblvm compare`` (a comparison spec's methods over seeds and a [sweep]
grid, tabulated and drawn), ``eblvm search`` (a hyperparameter search with Optuna), the
launchers that send runs to a Slurm cluster through submitit (``--launcher slurm``; and
``submitit-local``, the same jobs as processes on this machine), and the readers ``eblvm
validate`` checks comparison and search specs with.

A plugin as any other, switched off by leaving ``experiments`` out of ``EBLVM_LOAD_PLUGINS``: it
uses eblvm's public API alone (``eblvm``, ``eblvm.plugin``, ``eblvm.tools``), and importing it
loads neither Optuna nor submitit, which the commands import when they run.
"""

from __future__ import annotations

from eblvm.plugin import hookimpl


@hookimpl
def register_launchers(register):
    from eblvm_experiments.launcher import SlurmConfig, slurm, submitit_local

    register("slurm", slurm, SlurmConfig)
    register("submitit-local", submitit_local, SlurmConfig)


@hookimpl
def register_spec_readers(register):
    from eblvm_experiments.search_spec import read_search
    from eblvm_experiments.spec import read_compare

    register("compare", read_compare)
    register("search", read_search)


@hookimpl
def register_commands(register):
    from eblvm_experiments.commands import commands

    for info in commands.registered_commands:
        register(info.callback, context_settings=info.context_settings, epilog=info.epilog)
