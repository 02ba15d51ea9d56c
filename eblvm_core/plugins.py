"""The plugin manager: every plugin, bundled or third-party, arrives through the ``eblvm``
entry-point group (bundled ones are declared in eblvm's own pyproject) and registers its
components through pluggy hooks.

Bundled plugins register before third-party ones, so a third-party plugin cannot take over a
bundled name: registering a taken name fails that plugin, naming both. ``EBLVM_LOAD_PLUGINS``
(comma-separated entry-point names) pins which load; unset, all do. ``EBLVM_PLUGIN_MODULES``
(comma-separated module names) loads modules as plugins without packaging them (a plugin in
development, a test). A plugin that fails to import or register is reported by name and its
components are withdrawn; the others keep working.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable, Iterable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import attrs
import pluggy

from eblvm_core import hookspecs
from eblvm_core.errors import EblvmError
from eblvm_core.registry import KINDS, Registry, did_you_mean

GROUP = "eblvm"
DISTRIBUTION = "eblvm"  # the distribution whose entry points are the bundled plugins
BUILTIN = {"core": "eblvm_core.optim"}  # always loaded, whatever EBLVM_LOAD_PLUGINS says


def checkout() -> Path | None:
    """The source tree eblvm runs from (its pyproject.toml names the eblvm distribution): an
    editable install (``pip install -e .``) or a checkout on the path; None when eblvm was
    installed from a package index or a wheel."""
    import tomllib

    root = Path(__file__).resolve().parent.parent
    try:
        name = tomllib.loads((root / "pyproject.toml").read_text()).get("project", {}).get("name")
    except (OSError, ValueError):
        return None
    return root if name == DISTRIBUTION else None


def install_hint(extra: str) -> str:
    """The pip command that adds eblvm's optional ``extra`` (``wandb``, ``mlflow``, ``fid``) as
    eblvm is installed here: from a checkout ``pip install -e ".[extra]"`` when the working
    directory is the checkout, else with the checkout's path; otherwise ``pip install
    "eblvm[extra]"``. Every hint that names an extra comes from here."""
    root = checkout()
    if root is None:
        return f'pip install "{DISTRIBUTION}[{extra}]"'
    try:
        here = Path.cwd().resolve() == root
    except OSError:  # the working directory is gone
        here = False
    return f'pip install -e "{"." if here else root}[{extra}]"'


@attrs.define
class PluginInfo:
    name: str
    module: str
    components: dict[str, list[str]] = attrs.field(factory=dict)


@attrs.frozen
class Command:
    """A command a plugin registers: its name, the typer function, the plugin, and the settings
    ``app.command`` takes for it (``context_settings``, ``epilog``, ``help``...)."""

    name: str
    fn: Callable[..., Any]
    plugin: str
    settings: dict[str, Any] = attrs.field(factory=dict)


@attrs.define
class Loaded:
    """Registries per kind, what each plugin registered, the plugins that failed, and plugin commands."""

    registries: dict[str, Registry]
    plugins: list[PluginInfo]
    failed: dict[str, str]
    commands: list[Command]

    def __getitem__(self, kind: str) -> Registry:
        return self.registries[kind]


_loaded: Loaded | None = None


def _wanted(names: list[str]) -> set[str]:
    pinned = os.environ.get("EBLVM_LOAD_PLUGINS")
    if pinned is None:
        return set(names)
    return {n.strip() for n in pinned.split(",") if n.strip()}


def check_pins(installed: Iterable[str] | None = None) -> None:
    """A plugin EBLVM_LOAD_PLUGINS pins that is not installed is an EblvmError: one line, rather
    than the missing components of every recipe that needs it (``installed``: the entry points'
    names, else read from the installed distributions' metadata; nothing imported)."""
    eps = sorted(installed if installed is not None else (ep.name for ep in entry_points(group=GROUP)))
    missing = sorted(_wanted(eps) - set(eps))
    if missing:
        names = ", ".join(f"'{name}'" for name in missing)
        hint = did_you_mean(missing[0], eps)
        raise EblvmError(f"EBLVM_LOAD_PLUGINS names {names}, not installed{hint}; installed plugins: {', '.join(eps)}")


def _candidates() -> list[tuple[str, str, Callable[[], Any]]]:
    """(name, module path, loader) of every plugin to load: the core, bundled, third-party, extra modules."""
    eps = {ep.name: ep for ep in entry_points(group=GROUP)}
    check_pins(eps)
    wanted = _wanted(list(eps))

    def bundled_first(name: str) -> tuple[bool, str]:
        dist = getattr(eps[name], "dist", None)
        return (getattr(dist, "name", None) != DISTRIBUTION, name)

    found: list[tuple[str, str, Callable[[], Any]]] = [
        (name, module, functools.partial(importlib.import_module, module)) for name, module in BUILTIN.items()
    ]
    found += [(name, eps[name].value, eps[name].load) for name in sorted(wanted & set(eps), key=bundled_first)]
    extra = [m.strip() for m in os.environ.get("EBLVM_PLUGIN_MODULES", "").split(",") if m.strip()]
    found += [(module, module, functools.partial(importlib.import_module, module)) for module in extra]
    return found


def _invalid(pm: pluggy.PluginManager, name: str, exc: pluggy.PluginValidationError) -> str:
    """Why pluggy refused plugin ``name``: each of its hooks that matches no hookspec, with the
    closest hookspec's name, or else pluggy's own message."""
    plugin = pm.get_plugin(name)
    callers = (pm.get_hookcallers(plugin) or []) if plugin is not None else []
    unknown = [caller.name for caller in callers if not caller.has_spec()]
    if not unknown:
        return str(exc).split(" in plugin ")[0]
    specs = [hook for hook, caller in vars(pm.hook).items() if not hook.startswith("_") and caller.has_spec()]
    return "; ".join(f"unknown hook '{hook}'{did_you_mean(hook, specs)}" for hook in unknown)


def load(force: bool = False, warn: bool = True) -> Loaded:
    """Load plugins once (cached) and fill the registries through the hooks."""
    global _loaded
    if _loaded is not None and not force:
        return _loaded
    pm = pluggy.PluginManager(GROUP)
    pm.add_hookspecs(hookspecs)
    failed: dict[str, str] = {}
    modules: dict[str, str] = {}
    for name, module_path, loader in _candidates():
        try:
            pm.register(loader(), name=name)
            pm.check_pending()  # a hook name that matches no hookspec (a typo)
        except pluggy.PluginValidationError as exc:
            failed[name] = _invalid(pm, name, exc)
            if pm.get_plugin(name) is not None:
                pm.unregister(name=name)
        except (Exception, SystemExit) as exc:  # a broken plugin must not take the others down
            failed[name] = f"{type(exc).__name__}: {exc}"
        else:
            modules[name] = module_path

    registries = {kind.name: Registry(kind.name) for kind in KINDS}
    infos = {name: PluginInfo(name, path) for name, path in modules.items()}
    commands: list[Command] = []
    hooks = [(kind.name, getattr(pm.hook, f"register_{kind.name}")) for kind in KINDS]
    for kind, caller in hooks:
        for impl in caller.get_hookimpls():  # in registration order: the core, bundled, third-party
            name = impl.plugin_name
            if name in failed:
                continue
            registry = registries[kind]
            before = set(registry.names())
            try:
                impl.function(register=lambda *args, _r=registry, _p=name, **kw: _r.add(*args, plugin=_p, **kw))
            except (Exception, SystemExit) as exc:
                failed[name] = f"{type(exc).__name__}: {exc}"
                for other in registries.values():
                    other.withdraw(name)
                continue
            added = sorted(set(registry.names()) - before)
            if added:
                infos[name].components.setdefault(kind, []).extend(added)
    for impl in pm.hook.register_commands.get_hookimpls():
        if impl.plugin_name not in failed:
            impl.function(
                register=lambda fn, name=None, _p=impl.plugin_name, **settings: commands.append(
                    Command(name or fn.__name__.replace("_", "-"), fn, _p, settings)
                )
            )
    if warn:
        for name, why in failed.items():
            print(f"eblvm: plugin '{name}' failed to load and was skipped: {why}", file=sys.stderr)
    _loaded = Loaded(registries, [i for n, i in infos.items() if n not in failed], failed, commands)
    return _loaded


def registry(kind: str) -> Registry:
    return load()[kind]
