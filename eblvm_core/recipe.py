"""TOML recipes -> validated, frozen configs. Every error names the file, section and key."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, Literal

import attrs
import cattrs

from eblvm_core.config import coerce, non_negative, option, positive, structure
from eblvm_core.errors import ConfigError
from eblvm_core.plugins import Loaded, load
from eblvm_core.registry import KINDS, Entry, did_you_mean

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
        "cost of many small kernels) when the estimator declares it safe and the rates are constant",
    )
    log_every: int = option(100, "steps between logged (averaged) training metrics", positive)
    eval_every: int = option(0, "steps between evaluations; 0 evaluates at the end only", non_negative)
    checkpoint_every: int = option(1000, "steps between checkpoints (one is also written at the end)", positive)
    select_metric: str | None = option(
        None, "eval scalar (e.g. 'eval/exact-loglik/val_loglik') whose best value saves checkpoints/best.pt"
    )
    select_mode: Literal["max", "min"] = option("max", "whether a higher or a lower select_metric is better")


SINGLE = {k.section: k.name for k in KINDS if k.section is not None and not k.many}
LISTS = {k.section: k.name for k in KINDS if k.section is not None and k.many}
REQUIRED = tuple(k.section for k in KINDS if k.required)
TOP_LEVEL = ["run", *SINGLE, "optim", *LISTS]
OPTIM_KEYS = ("schedule", "ema")  # keys of [optim.<role>] that the core handles, not the optimizer
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
    path: str
    run: RunConfig
    parts: dict[str, Section]
    optim: dict[str, Role]
    evals: list[Section]
    logs: list[Section]

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
        if self.logs:
            out["log"] = [clean(s) for s in self.logs]
        return out


def parse_value(text: str) -> Any:
    """A TOML value (1e-3, true, "x", [1, 2]); anything else is taken as a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Apply ``section.key=value`` (``optim.model.lr=1e-3``, ``eval.0.n_grid=200``) to ``raw``."""
    path, sep, text = override.partition("=")
    keys = path.strip().split(".")
    if not sep or len(keys) < 2 or not all(keys):
        raise ConfigError("", None, f"override '{override}' must look like section.key=value")
    node: Any = raw
    for i, key in enumerate(keys[:-1]):
        where = ".".join(keys[: i + 1])
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise ConfigError(where, None, f"override '{override}': no item {key} (there are {len(node)})")
            node = node[int(key)]
        elif isinstance(node, dict):
            if key not in node and i == 0 and key not in TOP_LEVEL:
                raise ConfigError(key, None, f"override '{override}': unknown section{did_you_mean(key, TOP_LEVEL)}")
            if key not in node and keys[0] == "optim" and i == 1:  # an override never adds a role
                hint = did_you_mean(key, list(node))
                raise ConfigError(f"optim.{key}", None, f"override '{override}': the recipe has no such role{hint}")
            node = node.setdefault(key, {})
        else:
            raise ConfigError(
                ".".join(keys[: i - 1]), keys[i - 1], f"override '{override}': a value, not a section holding '{key}'"
            )
    if not isinstance(node, dict):
        section, key = ".".join(keys[:-2]), keys[-2]
        raise ConfigError(section, key, f"override '{override}': a value, not a section holding '{keys[-1]}'")
    node[keys[-1]] = parse_value(text.strip())


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
    """Check every section of a parsed recipe against the registries; raise ConfigError."""
    plugins = plugins or load()
    try:
        _check_text(raw, "")
        for key in raw:
            if key not in TOP_LEVEL:
                raise ConfigError(
                    key, None, f"unknown section{did_you_mean(key, TOP_LEVEL)}; valid: {', '.join(TOP_LEVEL)}"
                )
        for key in REQUIRED:
            if key not in raw:
                raise ConfigError(key, None, "required section is missing")
        run_body = raw.get("run", {})
        if not isinstance(run_body, dict):
            raise ConfigError("run", None, "must be a table")
        run = structure(RunConfig, run_body, "run")
        parts = {label: _component(label, raw[label], kind, plugins) for label, kind in SINGLE.items() if label in raw}
        optim_raw = raw.get("optim", {})
        if not isinstance(optim_raw, dict):
            raise ConfigError("optim", None, "must hold tables such as [optim.model]")
        optim = {name: _role(name, body, plugins) for name, body in optim_raw.items()}
        lists: dict[str, list[Section]] = {}
        for label, kind in LISTS.items():
            items = raw.get(label, [])
            if not isinstance(items, list):
                raise ConfigError(label, None, f"must be an array of tables: write [[{label}]]")
            lists[label] = [_component(f"{label}.{i}", body, kind, plugins) for i, body in enumerate(items)]
        if "log" not in raw and DEFAULT_LOGGER in plugins["loggers"]:
            lists["log"] = [_component("log.0", {"kind": DEFAULT_LOGGER}, "loggers", plugins)]
        return Recipe(path, run, parts, optim, lists["eval"], lists["log"])
    except ConfigError as exc:
        exc.file = exc.file or path
        raise


def read(path: str | Path) -> dict[str, Any]:
    """Parse a TOML file; a missing, unreadable, binary or malformed file becomes a ConfigError."""
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


def load_recipe(
    path: str | Path,
    overrides: list[str] = (),
    plugins: Loaded | None = None,
    evals: list[dict[str, Any]] | None = None,
) -> Recipe:
    """Read, override and validate a recipe file; ``evals`` ([[eval]] tables) replace its
    evaluators before the overrides apply."""
    raw = read(path)
    if evals is not None:
        raw["eval"] = [dict(table) for table in evals]
    try:
        for override in overrides:
            apply_override(raw, override)
    except ConfigError as exc:
        exc.file = str(path)
        raise
    return validate(raw, str(path), plugins)


# Keys that may differ between a run's recipe and a resumed (or evaluated) one: how long to train,
# how often to log, evaluate and checkpoint, where (device, threads, the data folder), and what
# to evaluate and where to log. Everything else decides what is trained and is fixed for a run.
RESUMABLE = (
    "run.steps",
    "run.log_every",
    "run.eval_every",
    "run.checkpoint_every",
    "run.threads",
    "run.device",
    "run.cuda_graph",
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
            raise ConfigError(
                section,
                key,
                f"cannot change {when} (the run has {old!r}, the override gives {new!r}); what may change: {allowed}",
                file=after.path,
            )


def with_run(recipe: Recipe, **changes: Any) -> Recipe:
    """A copy of the recipe with [run] fields changed (e.g. the seed written back)."""
    return attrs.evolve(recipe, run=attrs.evolve(recipe.run, **changes))
