"""Pluggy hook specifications: ``register_<kind>(register)`` for every kind of
``eblvm_core.registry.KINDS``, and ``register_commands``.

A plugin implements a hook with ``@hookimpl`` and calls ``register(name, factory, ConfigClass)``
once per component; ``factory(config, parts)`` builds it (see ``eblvm_core.contracts.Parts``).
``register_commands`` receives ``register(fn, name=None)``, which adds a typer command to the
``eblvm`` CLI.
"""

from __future__ import annotations

import pluggy

from eblvm_core.registry import KINDS

hookspec = pluggy.HookspecMarker("eblvm")
hookimpl = pluggy.HookimplMarker("eblvm")


def _spec(name: str, doc: str):
    def spec(register):
        pass

    spec.__name__ = spec.__qualname__ = name
    spec.__doc__ = doc
    return hookspec(spec)


for _kind in KINDS:
    globals()[f"register_{_kind.name}"] = _spec(
        f"register_{_kind.name}", f"Register {_kind.doc[0].lower()}{_kind.doc[1:]}"
    )


@hookspec
def register_commands(register):
    """Register extra CLI commands: ``register(fn, name=None)``."""


HOOKS = tuple(f"register_{k.name}" for k in KINDS) + ("register_commands",)
