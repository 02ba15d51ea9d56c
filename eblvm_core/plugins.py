"""The plugin manager: every plugin, bundled or third-party, arrives through the ``eblvm``
entry-point group (bundled ones are declared in eblvm's own pyproject).

``EBLVM_LOAD_PLUGINS`` (comma-separated entry-point names) pins which load; unset, all do.
A plugin that fails to import or register is reported by name and skipped.
"""

from __future__ import annotations

import importlib
import os
import sys
from importlib.metadata import entry_points
from typing import Any

import attrs
import pluggy

from eblvm_core import hookspecs
from eblvm_core.registry import KINDS, Registry

GROUP = "eblvm"
BUILTIN = {"core": "eblvm_core.optim"}  # always loaded, whatever EBLVM_LOAD_PLUGINS says


@attrs.define
class PluginInfo:
    name: str
    module: str
    components: dict[str, list[str]] = attrs.field(factory=dict)


@attrs.define
class Loaded:
    """Registries per kind, what each plugin registered, and the plugins that failed."""

    registries: dict[str, Registry]
    plugins: list[PluginInfo]
    failed: dict[str, str]
    commands: list[tuple[str, Any, str]]

    def __getitem__(self, kind: str) -> Registry:
        return self.registries[kind]


_loaded: Loaded | None = None


def _selected(names: list[str]) -> set[str]:
    pinned = os.environ.get("EBLVM_LOAD_PLUGINS")
    if pinned is None:
        return set(names)
    return {n.strip() for n in pinned.split(",") if n.strip()}


def load(force: bool = False, warn: bool = True) -> Loaded:
    """Load plugins once (cached) and fill the registries."""
    global _loaded
    if _loaded is not None and not force:
        return _loaded
    pm = pluggy.PluginManager("eblvm")
    pm.add_hookspecs(hookspecs)
    eps = {ep.name: ep for ep in entry_points(group=GROUP)}
    wanted = _selected(list(eps))
    failed: dict[str, str] = {}
    for name in sorted(wanted - set(eps)):
        failed[name] = "named in EBLVM_LOAD_PLUGINS but not installed"
    modules = {}
    for name, module_name in BUILTIN.items():
        pm.register(importlib.import_module(module_name), name=name)
        modules[name] = module_name
    for name in sorted(wanted & set(eps)):
        try:
            module = eps[name].load()
            pm.register(module, name=name)
        except Exception as exc:  # a broken plugin must not take the others down
            failed[name] = f"{type(exc).__name__}: {exc}"
            continue
        try:
            pm.check_pending()  # a hook name that matches no hookspec (a typo)
        except pluggy.PluginValidationError as exc:
            pm.unregister(name=name)
            failed[name] = str(exc).split(" in plugin ")[0]
            continue
        modules[name] = eps[name].value

    registries = {kind: Registry(kind) for kind in KINDS}
    infos: list[PluginInfo] = []
    commands: list[tuple[str, Any, str]] = []
    for name in modules:
        plugin = pm.get_plugin(name)
        info = PluginInfo(name, modules[name])
        try:
            for kind in KINDS:
                hook = getattr(plugin, f"register_{kind}", None)
                if hook is None:
                    continue
                registry = registries[kind]
                registry.current_plugin = name
                before = set(registry.names())
                hook(register=registry.add)
                added = sorted(set(registry.names()) - before)
                if added:
                    info.components[kind] = added
            cmd_hook = getattr(plugin, "register_commands", None)
            if cmd_hook is not None:
                cmd_hook(register=lambda fn, name_=None, _p=name: commands.append((name_ or fn.__name__.replace("_", "-"), fn, _p)))
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
            continue
        infos.append(info)
    if warn:
        for name, why in failed.items():
            print(f"eblvm: plugin '{name}' failed to load and was skipped: {why}", file=sys.stderr)
    _loaded = Loaded(registries, infos, failed, commands)
    return _loaded


def registry(kind: str) -> Registry:
    return load()[kind]
