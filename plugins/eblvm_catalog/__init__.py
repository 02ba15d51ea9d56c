"""What is at hand: ``eblvm recipes`` (the bundled recipes and specs, each with its first comment
line; ``eblvm recipes copy NAME [DEST]`` writes an editable copy) and ``eblvm runs [DIR]`` (each
run under a folder: name, start, status, steps, the last evaluation's headline metric, device).

A plugin as any other, on eblvm's public API alone; it reads files and imports no torch."""

from __future__ import annotations

from eblvm.plugin import hookimpl


@hookimpl
def register_commands(register):
    from eblvm_catalog.commands import recipes, runs

    register(recipes)
    register(runs)
