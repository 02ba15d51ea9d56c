"""How a run is asked for, and the interface of the launchers that train it elsewhere than in this
process (``eblvm run --launcher NAME``; a plugin registers them with ``register_launchers``).

A launcher's options are one attrs config class, as a component's are: its fields are the
command's ``--option`` flags when the launcher is chosen (``launcher_options`` reads them from the
arguments the command passes on) and a spec's ``[launcher]`` table, so every option is declared once.
"""

from __future__ import annotations

import os
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import click

from eblvm_core.cli_support import fail
from eblvm_core.config import non_negative, positive
from eblvm_core.rundir import RUN_DIR_FILE

__all__ = ["RUN_DIR_FILE", "Launcher", "RunRequest", "describe_options", "launcher_options", "option_flag", "owner_of"]


def _strings(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(values)


def _path_or_none(path: str | os.PathLike[str] | None) -> Path | None:
    return None if path is None else Path(path)


def _path(path: str | os.PathLike[str]) -> Path:
    return Path(path)


@attrs.frozen
class RunRequest:
    """What to train: a recipe (a file's path, TOML-ready data or a ``Recipe``) with ``-o``
    overrides, or the run directory to ``resume`` (a run's name folder: its latest run) with the
    overrides a resume may take; ``device`` instead of the recipe's; ``out`` the folder of run
    directories; ``command`` what run.json records as having asked for it (default: the command
    line)."""

    recipe: Any = None
    overrides: tuple[str, ...] = attrs.field(default=(), converter=_strings)
    resume: Path | None = attrs.field(default=None, converter=_path_or_none)
    device: str | None = None
    out: Path = attrs.field(default=Path("runs"), converter=_path)
    command: str | None = None


class Launcher:
    """Trains runs elsewhere than in this process (a cluster's jobs). The factory registered for
    it gets the launcher's config (its options, from the command line) and returns the launcher.

    ``runs_as`` names what a launched run is, for errors ("a cluster job"). ``submit`` sends one
    run (``eblvm run --launcher``): it checks the recipe, or the run to resume, here first, says
    through ``echo`` where the run lives, and with ``wait`` watches it to its end and echoes its
    final evaluation (``name: value``) and ``done: RUN_DIR`` as ``eblvm run`` does. The job's
    rank 0 names its run directory in the file ``$EBLVM_RUN_DIR_FILE`` when that is set
    (``RUN_DIR_FILE``), so a launcher can find the run of a job it restarts."""

    runs_as: str = "a job elsewhere"

    def submit(self, request: RunRequest, wait: bool, echo: Callable[[str], None]) -> None:
        raise NotImplementedError


def option_flag(name: str) -> str:
    """The command-line flag of a config field: ``array_parallelism`` -> ``--array-parallelism``."""
    return "--" + name.replace("_", "-")


def _option(field: attrs.Attribute, hint: Any) -> click.Option:
    """A click option for one config field, absent (None) unless given: numbers keep their
    validators' bounds, a ``dict`` takes repeatable KEY=VALUE (KEY alone: true), a ``list`` repeats."""
    help_text = field.metadata.get("help", "")
    args = typing.get_args(hint)
    origin = typing.get_origin(hint) or hint
    if origin in (dict, list):
        more = " (KEY=VALUE, repeatable)" if origin is dict else " (repeatable)"
        return click.Option([option_flag(field.name)], multiple=True, help=help_text + more)
    if hint is int or set(args) == {int, type(None)}:
        low = 1 if field.validator is positive else 0 if field.validator is non_negative else None
        kind: Any = click.IntRange(min=low) if low is not None else click.INT
    elif hint is float or set(args) == {float, type(None)}:
        kind = click.FLOAT
    else:  # strings, and unions such as int | str (a time limit) given as text
        kind = click.STRING
    return click.Option([option_flag(field.name)], type=kind, default=None, help=help_text)


def _fields(config: type, skip: Sequence[str]) -> list[tuple[attrs.Attribute, Any]]:
    hints = typing.get_type_hints(config)
    return [(f, hints[f.name]) for f in attrs.fields(config) if f.name not in skip]


def _value(raw: Any, hint: Any) -> Any:
    """A flag's text as the config field's value: KEY=VALUE pairs as a dict, whole numbers of an
    ``int | str`` field as ints, repeated values as a list."""
    origin = typing.get_origin(hint) or hint
    if origin is dict:
        table: dict[str, Any] = {}
        for pair in raw:
            key, sep, value = pair.partition("=")
            if not key.strip():
                raise click.BadParameter(f"takes KEY=VALUE (e.g. account=proj), got {pair!r}")
            table[key.strip().lstrip("-")] = value if sep else True
        return table
    if origin is list:
        return list(raw)
    if isinstance(raw, str) and int in typing.get_args(hint) and raw.strip().isdigit():
        return int(raw)
    return raw


def launcher_options(
    config: type, args: Sequence[str], skip: Sequence[str] = (), command: str = "eblvm"
) -> dict[str, Any]:
    """The options of a launcher given on a command line (``args``, what the command itself did
    not take), as its config's keys: every field of ``config`` but those in ``skip`` is a flag
    (``option_flag``). Those not given are absent. A bad value or an unknown option is one line
    (exit 2), as a command's own options' are."""
    fields = _fields(config, skip)
    parser = click.Command(command, params=[_option(field, hint) for field, hint in fields], add_help_option=False)
    try:
        return _given(parser, fields, args, command)
    except click.ClickException as exc:  # click's own, which typer (on a click of its own) does not catch
        fail(exc.format_message())


def _given(
    parser: click.Command, fields: list[tuple[attrs.Attribute, Any]], args: Sequence[str], command: str
) -> dict[str, Any]:
    with parser.make_context(command, list(args)) as ctx:
        given: dict[str, Any] = {}
        for field, hint in fields:
            raw = ctx.params[field.name]
            if raw is not None and raw != ():
                try:
                    given[field.name] = _value(raw, hint)
                except click.BadParameter as exc:
                    exc.param_hint = option_flag(field.name)
                    raise
        return given


def owner_of(flag: str, launchers: Mapping[str, type]) -> str | None:
    """The first launcher (name -> config class) one of whose options is ``flag`` (``--partition``)."""
    for name, config in launchers.items():
        if any(option_flag(f.name) == flag for f in attrs.fields(config)):
            return name
    return None


def describe_options(config: type, skip: Sequence[str] = ()) -> str:
    """The launcher's options for a command's help: one ``--flag: help`` line each."""
    return "\n".join(f"{option_flag(f.name)}: {f.metadata.get('help', '')}" for f, _hint in _fields(config, skip))
