"""TOML recipes -> validated, frozen configs. Every error names the file, section and key."""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
import cattrs

from eblvm_core.config import coerce, non_negative, option, positive, structure
from eblvm_core.errors import ConfigError
from eblvm_core.plugins import Loaded, load
from eblvm_core.registry import KINDS, Entry, did_you_mean, option_default

DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?|mps")


def _device(_inst: Any, _attr: Any, value: str) -> None:
    if not DEVICE.fullmatch(value):
        raise ValueError(f"must be auto, cpu, cuda, cuda:N or mps, got {value!r}")


def _run_name(_inst: Any, _attr: Any, value: str) -> None:
    """A run name is one folder inside ``--out``: never a path that leaves it."""
    if not value or value in (".", "..") or "/" in value or "\\" in value or Path(value).is_absolute():
        raise ValueError(f"must be a plain folder name (no '/', '\\', '..' or absolute path), got {value!r}")


def _seed(_inst: Any, _attr: Any, value: int | None) -> None:
    if value is not None and not 0 <= value < 2**63:
        raise ValueError(f"must be in [0, 2^63), got {value}")


def _ema(_inst: Any, _attr: Any, value: float | None) -> None:
    if value is not None and not 0.0 < value < 1.0:
        raise ValueError(f"must be in (0, 1), got {value}")


@attrs.frozen
class RunConfig:
    """The [run] section: schedule, seed, device and intervals (in optimizer steps)."""

    name: str = option("run", "run name; the run directory is <out>/<name>/<timestamp>", _run_name)
    seed: int | None = option(None, "random seed in [0, 2^63); chosen at random and written back when absent", _seed)
    steps: int = option(1000, "number of training steps", positive)
    batch_size: int = option(100, "mini-batch size", positive)
    device: str = option("auto", "auto (cuda when available), cpu, cuda, cuda:N or mps", _device)
    dtype: Literal["float32", "float64"] = option("float32", "dtype of parameters and data")
    precision: Literal["fp32", "bf16", "fp16"] = option(
        "fp32",
        "autocast precision of training steps (bf16, fp16 with a gradient scaler) for estimators that declare it safe",
    )
    threads: int = option(
        0,
        "CPU threads for torch; 0 chooses: 1 on a CPU for models under 10,000 parameters (faster, the same "
        "numbers), else torch's default",
        non_negative,
    )
    cuda_graph: bool = option(
        True,
        "on a GPU, capture the training step in a CUDA graph and replay it (the same numbers, without the launch "
        "cost of many small kernels) when the estimator declares it safe; scheduled rates live in device tensors",
    )
    cudnn_benchmark: bool = option(
        False,
        "on a GPU, let cuDNN time its convolution algorithms for the run's shapes and use the fastest (as "
        "benchmarks/bench_deep.py does); the choice depends on timings, so two runs may differ in the last bits",
    )
    log_every: int = option(100, "steps between logged (averaged) training metrics", positive)
    eval_every: int = option(0, "steps between evaluations; 0 evaluates at the end only", non_negative)
    checkpoint_every: int = option(1000, "steps between checkpoints (one is also written at the end)", positive)
    select_metric: str | None = option(
        None, "eval scalar (e.g. 'eval/exact-loglik/val_loglik') whose best value saves checkpoints/best.pt"
    )
    select_mode: Literal["max", "min"] = option("max", "whether a higher or a lower select_metric is better")
    keep_every: int | None = option(
        None,
        "steps between kept checkpoints checkpoints/step-<N>.pt (never overwritten; a schedule of their own, "
        "independent of checkpoint_every); absent: none are kept",
        positive,
    )
    patience: int | None = option(
        None,
        "early stopping: end the run at the patience-th evaluation in a row that does not improve on the best "
        "select_metric (needs select_metric and eval_every); absent: never stop early",
        positive,
    )

    def __attrs_post_init__(self) -> None:
        if self.patience is None:
            return
        if self.select_metric is None:
            raise ConfigError("run", "patience", "counts evaluations without improvement of select_metric: set it too")
        if not self.eval_every:
            raise ConfigError(
                "run", "patience", "counts evaluations, but eval_every = 0 evaluates only at the end: set eval_every"
            )


SINGLE = {k.section: k.name for k in KINDS if k.section is not None and not k.many}
LISTS = {k.section: k.name for k in KINDS if k.section is not None and k.many}
REQUIRED = tuple(k.section for k in KINDS if k.required)
TOP_LEVEL = ["run", *SINGLE, "optim", *LISTS]
DEFAULT_LOGGER = "tensorboard"  # used when a recipe has no [[log]] (write `log = []` for none)


@attrs.frozen
class Section:
    """One component of a recipe: its section label, registry entry and validated config."""

    label: str
    entry: Entry
    config: Any

    @property
    def kind(self) -> str:
        return self.entry.name


@attrs.frozen
class Role:
    """One [optim.<role>] section: the optimizer, its learning-rate schedule and the EMA decay of the role's parameters."""

    optimizer: Section
    schedule: Section
    ema: float | None = None


@attrs.frozen
class Recipe:
    """A validated recipe: ``path`` names its file (``<recipe dict>`` for data), ``overrides`` the
    ``-o`` values applied to it, which errors found later (building it, resuming with it) name
    where they caused the error (``blame``)."""

    path: str
    run: RunConfig
    parts: dict[str, Section]
    optim: dict[str, Role]
    evals: list[Section]
    logs: list[Section]
    overrides: tuple[str, ...] = ()

    def blame(self, exc: ConfigError) -> None:
        """Name where each error of ``exc`` comes from, unless it is named already: the ``-o``
        value that set its section and key (``blame``), else the recipe's file."""
        blame(exc, self.overrides)
        for error in exc.errors:
            error.file = error.file or self.path

    def default_of(self, path: str) -> Any:
        """The default of the option at a dotted path of ``to_dict()`` ("generator.base",
        "optim.energy.lr", "optim.energy.schedule.gamma", "run.seed"), or attrs.NOTHING where the
        path names no option with a default."""
        section, _, key = path.rpartition(".")
        head, _, rest = section.partition(".")
        if section == "run":
            config = self.run
        elif section in self.parts:
            config = self.parts[section].config
        elif head == "optim" and rest in self.optim:
            config = self.optim[rest].optimizer.config
        elif head == "optim" and rest.endswith(".schedule") and rest.removesuffix(".schedule") in self.optim:
            config = self.optim[rest.removesuffix(".schedule")].schedule.config
        else:
            return attrs.NOTHING
        field = attrs.fields_dict(type(config)).get(key) if attrs.has(type(config)) else None
        return attrs.NOTHING if field is None else option_default(field)

    def to_dict(self) -> dict[str, Any]:
        """The resolved recipe (defaults filled in), as TOML-ready data."""
        conv = cattrs.Converter()

        def clean(section: Section) -> dict[str, Any]:
            body = {k: v for k, v in conv.unstructure(section.config).items() if v is not None}
            return {"kind": section.kind, **body}

        out: dict[str, Any] = {"run": {k: v for k, v in conv.unstructure(self.run).items() if v is not None}}
        out.update({label: clean(s) for label, s in self.parts.items()})
        if self.optim:
            out["optim"] = {}
            for name, role in self.optim.items():
                body = {**clean(role.optimizer), "schedule": clean(role.schedule)}
                if role.ema is not None:
                    body["ema"] = role.ema
                out["optim"][name] = body
        if self.evals:
            out["eval"] = [clean(s) for s in self.evals]
        out["log"] = [clean(s) for s in self.logs]  # also `log = []`: an absent [[log]] means the default logger
        return out


def parse_value(text: str) -> Any:
    """A TOML value (1e-3, true, "x", [1, 2]); anything else is taken as a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


INDEX = re.compile(r"[0-9]+")


def override_path(override: str) -> str | None:
    """The dotted recipe path an ``-o`` value sets (``optim.model.lr``) or drops (``~eval.1`` ->
    ``eval.1``); None for text that is neither."""
    text = override.strip()
    if text.startswith("~"):
        return text[1:].strip() or None
    path, sep, _value = text.partition("=")
    return (path.strip() or None) if sep else None


def caused_by(error: ConfigError, overrides: Sequence[str]) -> str | None:
    """The last of ``overrides`` that set or dropped the section and key ``error`` names (or, for
    an error about a whole section or list item, something inside it), else None."""
    where = ".".join(filter(None, [error.section, error.key]))
    if not where:
        return None
    for override in reversed(overrides):
        path = override_path(override)
        if path is None:
            continue
        drop = override.strip().startswith("~")
        if where == path or (not drop and where.startswith(path + ".")):
            return override
        if error.key is None and not drop and path.startswith(where + "."):
            return override
    return None


def blame(exc: ConfigError, overrides: Sequence[str], file: str | None = None) -> None:
    """Name the ``-o`` value as the file of each error of ``exc`` it caused (``caused_by``)
    where the error names ``file`` or no file yet: ``-o run.stepz=3: [run] stepz: unknown key``."""
    for error in exc.errors:
        if error.file in (None, file):
            source = caused_by(error, overrides)
            if source is not None:
                error.file = f"-o {source}"


def from_override(exc: ConfigError, override: str) -> ConfigError:
    """An error ``apply_override`` raised, as an error of the ``-o`` value: named ``-o VALUE``, its
    message without the "override 'VALUE'" it began with."""
    for error in exc.errors:
        error.file = f"-o {override}"
        for prefix in (f"override '{override}': ", f"override '{override}' "):
            error.message = error.message.removeprefix(prefix)
    return exc


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> None:
    """Apply ``-o`` values to ``raw`` in order (``apply_override``); an error names the ``-o``
    value (``from_override``)."""
    for override in overrides:
        try:
            apply_override(raw, override)
        except ConfigError as exc:
            raise from_override(exc, override) from None


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Apply one ``-o`` override to ``raw`` (overrides apply left to right):

    - ``section.key=value`` sets a value (``optim.model.lr=1e-3``, ``eval.0.n_grid=200``);
      ``eval.N.key=value`` where N is the length of the [[eval]] (or [[log]]) list appends a new
      table (``eval.2.kind=density-plot`` on a recipe with two evaluators adds a third);
    - ``~section.key`` drops a key (its default applies again), ``~eval.N`` drops entry N of a
      list (the later ones move up), ``~section`` a whole section.
    """
    text = override.strip()
    if text.startswith("~"):
        _drop(raw, override, text[1:])
        return
    path, sep, value = override.partition("=")
    keys = path.strip().split(".")
    if not sep or len(keys) < 2 or not all(keys):
        raise ConfigError(
            "", None, f"override '{override}' must look like section.key=value (or ~section.key to drop a key)"
        )
    set_value(raw, keys, parse_value(value.strip()), f"override '{override}'")


def _list_section(node: dict[str, Any], key: str) -> None:
    """Make an absent [[eval]] or [[log]] list explicit before an override addresses its entries:
    empty, or for [[log]] the default logger a recipe without [[log]] gets."""
    if key in LISTS and key not in node:
        node[key] = [{"kind": DEFAULT_LOGGER}] if key == "log" else []


def _entry(items: list[Any], keys: list[str], i: int, what: str, append: bool) -> Any:
    """Entry ``keys[i]`` of the list ``items`` (at ``keys[:i]``); ``append``: index len(items)
    adds an empty table to a list of tables."""
    key, n = keys[i], len(items)
    where, listed = ".".join(keys[: i + 1]), ".".join(keys[:i])
    if INDEX.fullmatch(key) and int(key) < n:
        return items[int(key)]
    tables = all(isinstance(item, dict) for item in items)
    if append and tables and INDEX.fullmatch(key) and int(key) == n:
        items.append({})
        return items[-1]
    if not INDEX.fullmatch(key):
        raise ConfigError(
            listed,
            None,
            f"{what}: [[{listed}]] is a list: name an entry by its index, e.g. {listed}.0.kind, not '{key}'",
        )
    adds = f"; {listed}.{n}.<key>=<value> adds one" if append and tables else ""
    raise ConfigError(where, None, f"{what}: no item {key} (there are {n}{adds})")


def set_value(raw: dict[str, Any], keys: list[str] | str, value: Any, what: str | None = None) -> None:
    """Set the recipe value at ``keys`` (a dotted path or its parts) in ``raw``, creating tables
    on the way; an index equal to the length of a list of tables appends one. An override never
    adds an [optim.<role>]. ``what`` (e.g. "override 'a.b=1'") starts error messages."""
    keys = keys.split(".") if isinstance(keys, str) else list(keys)
    what = what or f"'{'.'.join(keys)}'"
    node: Any = raw
    for i, key in enumerate(keys[:-1]):
        if isinstance(node, list):
            node = _entry(node, keys, i, what, append=True)
        elif isinstance(node, dict):
            if key not in node and i == 0 and key not in TOP_LEVEL:
                raise ConfigError(key, None, f"{what}: unknown section{did_you_mean(key, TOP_LEVEL)}")
            if key not in node and keys[0] == "optim" and i == 1:  # an override never adds a role
                hint = did_you_mean(key, list(node))
                raise ConfigError(f"optim.{key}", None, f"{what}: the recipe has no such role{hint}")
            if i == 0:
                _list_section(node, key)
            node = node.setdefault(key, {})
        else:
            raise ConfigError(".".join(keys[: i - 1]), keys[i - 1], f"{what}: a value, not a section holding '{key}'")
    if isinstance(node, list):
        listed = ".".join(keys[:-1])
        if not INDEX.fullmatch(keys[-1]):
            _entry(node, keys, len(keys) - 1, what, append=False)  # refuses a key that is no index
        raise ConfigError(
            listed, None, f"{what}: an entry of [[{listed}]] is a table: set its keys, e.g. {'.'.join(keys)}.kind=..."
        )
    if not isinstance(node, dict):
        section, key = ".".join(keys[:-2]), keys[-2]
        raise ConfigError(section, key, f"{what}: a value, not a section holding '{keys[-1]}'")
    node[keys[-1]] = value


def _drop(raw: dict[str, Any], override: str, path: str) -> None:
    """``~a.b.c``: remove key c of table a.b, or entry c of list a.b."""
    keys = path.strip().split(".")
    what = f"override '{override}'"
    if "=" in path or not all(keys):
        raise ConfigError("", None, f"{what}: a drop looks like ~section.key or ~eval.N, without a value")
    node: Any = raw
    for i, key in enumerate(keys):
        last = i == len(keys) - 1
        if isinstance(node, list):
            if INDEX.fullmatch(key) and int(key) < len(node):
                if last:
                    del node[int(key)]
                    return
                node = node[int(key)]
            else:
                listed = ".".join(keys[:i])
                raise ConfigError(listed, None, f"{what}: no item {key} to drop (there are {len(node)})")
        elif isinstance(node, dict):
            if i == 0 and not last:
                _list_section(node, key)
            if key not in node:
                section = ".".join(keys[:i])
                hint = did_you_mean(key, [str(k) for k in node])
                raise ConfigError(
                    section or key, key if section else None, f"{what}: not in the recipe, nothing to drop{hint}"
                )
            if last:
                del node[key]
                return
            node = node[key]
        else:
            raise ConfigError(".".join(keys[: i - 1]), keys[i - 1], f"{what}: a value, not a section holding '{key}'")


def _component(label: str, body: Any, kind: str, plugins: Loaded) -> Section:
    if not isinstance(body, dict):
        raise ConfigError(label, None, "must be a table")
    if "kind" not in body:
        names = ", ".join(plugins[kind].names())
        raise ConfigError(label, "kind", f"missing; choose one of: {names}")
    name = body["kind"]
    if not isinstance(name, str):
        raise ConfigError(label, "kind", f"must be a string, got {name!r}")
    entry = plugins[kind].get(name, section=label)
    values = {k: v for k, v in body.items() if k != "kind"}
    return Section(label, entry, structure(entry.config, values, label))


def _role(name: str, body: Any, plugins: Loaded) -> Role:
    label = f"optim.{name}"
    if not isinstance(body, dict):
        raise ConfigError(label, None, "must be a table")
    body = dict(body)
    schedule = body.pop("schedule", {"kind": "constant"})
    ema = body.pop("ema", None)
    if ema is not None:
        try:
            ema = float(coerce(ema, float))
            _ema(None, None, ema)
        except (TypeError, ValueError) as exc:
            raise ConfigError(label, "ema", str(exc)) from None
    return Role(
        _component(label, body, "optimizers", plugins),
        _component(f"{label}.schedule", schedule, "schedules", plugins),
        ema,
    )


def _check_text(node: Any, section: str, key: str | None = None) -> None:
    """Refuse a NUL byte in any key or string of the recipe, naming its section and key."""
    if isinstance(node, str) and "\x00" in node:
        raise ConfigError(section, key, f"must not contain a NUL byte, got {node!r}")
    if isinstance(node, list):
        for child in node:
            _check_text(child, section, key)
    if not isinstance(node, dict):
        return
    for name, child in node.items():
        if "\x00" in name:
            raise ConfigError(section, repr(name), "a key must not contain a NUL byte")
        tables = isinstance(child, list) and bool(child) and all(isinstance(c, dict) for c in child)
        if key is None and (isinstance(child, dict) or tables):
            sub = f"{section}.{name}" if section else name
            for i, table in enumerate(child if tables else [child]):
                _check_text(table, f"{sub}.{i}" if tables else sub)
        else:
            _check_text(child, section, key or name)


def validate(raw: dict[str, Any], path: str, plugins: Loaded | None = None) -> Recipe:
    """Check every section of a parsed recipe against the registries; raise a ConfigError naming
    every bad key at once (``ConfigError.combine``: one line each), in the order of the sections."""
    plugins = plugins or load()
    errors: list[ConfigError] = []

    def checked(work: Callable[[], Any]) -> Any:
        try:
            return work()
        except ConfigError as exc:
            errors.append(exc)
            return None

    try:
        _check_text(raw, "")
    except ConfigError as exc:
        exc.file = exc.file or path
        raise
    meant = set()  # the sections an unknown one is a misspelling of: not also reported missing
    for key in raw:
        if key in (INCLUDE, REPLACE):
            errors.append(
                ConfigError("", key, "is resolved when a recipe file is read (recipe.read): give the recipe as a file")
            )
        elif key not in TOP_LEVEL:
            meant.update(difflib.get_close_matches(key, TOP_LEVEL, n=1))
            errors.append(
                ConfigError(key, None, f"unknown section{did_you_mean(key, TOP_LEVEL)}; valid: {', '.join(TOP_LEVEL)}")
            )
    missing = [key for key in REQUIRED if key not in raw and key not in meant]
    if missing:
        also = f" (so are {', '.join(f'[{key}]' for key in missing[1:])})" if missing[1:] else ""
        errors.append(ConfigError(missing[0], None, f"required section is missing{also}"))
    run_body = raw.get("run", {})
    if not isinstance(run_body, dict):
        errors.append(ConfigError("run", None, "must be a table"))
        run_body = {}
    run = checked(lambda: structure(RunConfig, run_body, "run"))
    parts = {}
    for label, kind in SINGLE.items():
        if label in raw:
            parts[label] = checked(lambda label=label, kind=kind: _component(label, raw[label], kind, plugins))
    optim_raw = raw.get("optim", {})
    if not isinstance(optim_raw, dict):
        errors.append(ConfigError("optim", None, "must hold tables such as [optim.model]"))
        optim_raw = {}
    optim = {name: checked(lambda name=name, body=body: _role(name, body, plugins)) for name, body in optim_raw.items()}
    lists: dict[str, list[Section]] = {}
    for label, kind in LISTS.items():
        items = raw.get(label, [])
        if not isinstance(items, list):
            errors.append(ConfigError(label, None, f"must be an array of tables: write [[{label}]]"))
            items = []
        lists[label] = [
            checked(lambda label=label, kind=kind, i=i, body=body: _component(f"{label}.{i}", body, kind, plugins))
            for i, body in enumerate(items)
        ]
    if errors:
        found = ConfigError.combine(errors)
        for error in found.errors:
            error.file = error.file or path
        raise found
    if "log" not in raw and DEFAULT_LOGGER in plugins["loggers"]:
        lists["log"] = [_component("log.0", {"kind": DEFAULT_LOGGER}, "loggers", plugins)]
    return Recipe(path, run, parts, optim, lists["eval"], lists["log"])


def parse(path: str | Path) -> dict[str, Any]:
    """Parse one TOML file, includes unresolved; a missing, unreadable, binary or malformed file
    becomes a ConfigError."""
    path = Path(path)
    file = str(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError("", None, "recipe file not found", file=file) from None
    except IsADirectoryError:
        raise ConfigError("", None, "is a directory, not a recipe file", file=file) from None
    except OSError as exc:
        raise ConfigError("", None, f"cannot read the recipe: {exc.strerror or exc}", file=file) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            "",
            None,
            f"not a UTF-8 text file (byte 0x{data[exc.start]:02x} at offset {exc.start}): a recipe is TOML text",
            file=file,
        ) from None
    if "\x00" in text:
        raise ConfigError(
            "", None, f"holds a NUL byte at offset {text.index(chr(0))}: a recipe is TOML text", file=file
        )
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("", None, f"invalid TOML: {exc}", file=file) from None


INCLUDE, REPLACE = "include", "replace"  # top-level keys of composition, resolved by ``read``


def read(path: str | Path) -> dict[str, Any]:
    """Parse a recipe (or comparison spec) file and resolve its includes: ``include = ["base.toml"]``
    (paths relative to the including file; included files may include others) merges the
    included files in order, then this file's own keys over them (``merge``); ``replace =
    ["eval"]`` lists keys of this file that replace the included value instead of being merged
    with (or appended to) it. A file reached twice (two files that include one base) is merged
    once, where it is first included. The result has neither key. A missing include, an include
    cycle or a wrong ``replace`` is a ConfigError naming the including file and the key."""
    return _compose(Path(path), str(path), (), set())


def _compose(path: Path, file: str, chain: tuple[tuple[Path, str], ...], done: set[Path]) -> dict[str, Any]:
    """``read`` of ``path`` (named ``file`` in errors), included from the files of ``chain``
    ((resolved path, name), outermost first); ``done`` holds the files merged so far."""
    raw = parse(path)
    includes, replace = raw.pop(INCLUDE, None), raw.pop(REPLACE, None)
    if includes is None:
        if replace is not None:
            raise ConfigError("", REPLACE, "names keys that replace the included files' values: set include", file=file)
        return raw
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not includes or not all(isinstance(n, str) and n for n in includes):
        raise ConfigError(
            "",
            INCLUDE,
            f'must be a file name or a list of them, e.g. include = ["base.toml"], got {includes!r}',
            file=file,
        )
    replaced = _replaced(replace, raw, file)
    chain = (*chain, (path.resolve(), file))
    merged: dict[str, Any] = {}
    for name in includes:
        target = Path(name) if Path(name).is_absolute() else path.parent / name
        shown = os.path.normpath(target)
        if not target.is_file():
            what = "is a directory, not a recipe file" if target.is_dir() else "no such file"
            raise ConfigError("", INCLUDE, f"'{name}': {what} ({shown})", file=file)
        resolved = target.resolve()
        on_chain = [p for p, _ in chain]
        if resolved in on_chain:
            loop = [named for _, named in chain[on_chain.index(resolved) :]]
            raise ConfigError(
                "", INCLUDE, f"'{name}' makes an include cycle: {' -> '.join([*loop, loop[0]])}", file=file
            )
        if resolved not in done:
            merged = merge(merged, _compose(target, shown, chain, done))
            done.add(resolved)
    return merge(merged, raw, replaced)


def _replaced(replace: Any, raw: dict[str, Any], file: str) -> frozenset[str]:
    """The dotted keys of a ``replace`` list, each a key of the file's own ``raw``."""
    if replace is None:
        return frozenset()
    if isinstance(replace, str):
        replace = [replace]
    if not isinstance(replace, list) or not all(isinstance(p, str) for p in replace):
        raise ConfigError(
            "", REPLACE, f'must be a list of keys of this file, e.g. replace = ["eval"], got {replace!r}', file=file
        )

    def paths(node: Any, prefix: str = "") -> list[str]:
        if not isinstance(node, dict):
            return []
        return [p for k, v in node.items() for p in [f"{prefix}{k}", *paths(v, f"{prefix}{k}.")]]

    own = paths(raw)
    for path in replace:
        if path not in own:
            raise ConfigError(
                "",
                REPLACE,
                f"'{path}' is not a key of this file{did_you_mean(path, own)}: nothing to replace with",
                file=file,
            )
    return frozenset(replace)


def _tables(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, dict) for item in value)


def merge(
    base: dict[str, Any], top: dict[str, Any], replace: frozenset[str] = frozenset(), prefix: str = ""
) -> dict[str, Any]:
    """``top`` over ``base`` (parsed TOML): tables merge key by key, a non-empty array of tables
    ([[eval]], [[log]]) is appended to the base's, anything else (values, plain arrays, ``eval =
    []``) replaces the base's, as does every dotted key in ``replace``."""
    out = dict(base)
    for key, value in top.items():
        path = f"{prefix}{key}"
        old = out.get(key)
        if path in replace or key not in out:
            out[key] = value
        elif isinstance(old, dict) and isinstance(value, dict):
            out[key] = merge(old, value, replace, f"{path}.")
        elif value and _tables(value) and _tables(old):
            out[key] = [*old, *value]
        else:
            out[key] = value
    return out


def load_recipe(
    path: str | Path,
    overrides: list[str] = (),
    plugins: Loaded | None = None,
    evals: list[dict[str, Any]] | None = None,
) -> Recipe:
    """Read (includes resolved, ``read``), override (``apply_override``, in order) and validate a
    recipe file; ``evals`` ([[eval]] tables) replace its evaluators before the overrides apply."""
    raw = read(path)
    if evals is not None:
        raw["eval"] = [dict(table) for table in evals]
    return validate_with(raw, str(path), overrides, plugins)


def validate_with(
    raw: dict[str, Any], path: str, overrides: Sequence[str] = (), plugins: Loaded | None = None
) -> Recipe:
    """``validate`` ``raw`` (read from ``path``) with ``-o`` values applied (``apply_overrides``):
    an error an override caused names it (``blame``), as do the errors the recipe meets later
    (``Recipe.blame``)."""
    overrides = list(overrides)
    apply_overrides(raw, overrides)
    try:
        recipe = validate(raw, path, plugins)
    except ConfigError as exc:
        blame(exc, overrides, path)
        raise
    return attrs.evolve(recipe, overrides=tuple(overrides))


# Keys that may differ between a run's recipe and a resumed (or evaluated) one: how long to train
# (steps, and the patience of early stopping), how often to log, evaluate and checkpoint, where (device, threads, the data folder), and what
# to evaluate and where to log. Everything else decides what is trained and is fixed for a run.
RESUMABLE = (
    "run.steps",
    "run.log_every",
    "run.eval_every",
    "run.checkpoint_every",
    "run.keep_every",
    "run.patience",
    "run.threads",
    "run.device",
    "run.cuda_graph",
    "run.cudnn_benchmark",
    "data.root",
    "eval",
    "log",
)


def _resumable(path: str) -> bool:
    return any(path == key or path.startswith(key + ".") for key in RESUMABLE)


def differences(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted path, value in a, value in b) wherever two resolved recipe dicts differ; None for absent."""
    if isinstance(a, dict) and isinstance(b, dict):
        found = []
        for key in [*a, *(k for k in b if k not in a)]:
            found += differences(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else str(key))
        return found
    return [] if a == b else [(prefix, a, b)]


def training_part(resolved: dict[str, Any]) -> dict[str, Any]:
    """A resolved recipe (``Recipe.to_dict()``) without the RESUMABLE keys: what a checkpoint was trained by."""

    def keep(node: Any, prefix: str) -> Any:
        if not isinstance(node, dict):
            return node
        return {
            k: keep(v, f"{prefix}.{k}" if prefix else k)
            for k, v in node.items()
            if not _resumable(f"{prefix}.{k}" if prefix else k)
        }

    return keep(resolved, "")


def _split(path: str) -> tuple[str, str]:
    section, _, key = path.rpartition(".")
    return section, key


def check_unchanged(before: Recipe, after: Recipe, when: str, also: tuple[str, ...] = ()) -> None:
    """Refuse ``after`` (the run's recipe with overrides) where it differs from ``before`` outside
    RESUMABLE and the sections ``also``: a ConfigError naming the first such key."""
    for path, old, new in differences(before.to_dict(), after.to_dict()):
        if not _resumable(path) and not any(path == key or path.startswith(key + ".") for key in also):
            section, key = _split(path)
            allowed = ", ".join((*RESUMABLE, *also))
            error = ConfigError(
                section,
                key,
                f"cannot change {when} (the run has {old!r}, the override gives {new!r}); what may change: {allowed}",
            )
            after.blame(error)
            raise error


def with_run(recipe: Recipe, **changes: Any) -> Recipe:
    """A copy of the recipe with [run] fields changed (e.g. the seed written back)."""
    return attrs.evolve(recipe, run=attrs.evolve(recipe.run, **changes))
