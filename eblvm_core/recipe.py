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


def _ema(_inst: Any, _attr: Any, value: float | None) -> None:
    if value is not None and not 0.0 < value < 1.0:
        raise ValueError(f"must be in (0, 1), got {value}")


@attrs.frozen
class RunConfig:
    """The [run] section: schedule, seed, device and intervals (in optimizer steps)."""

    name: str = option("run", "run name; the run directory is <out>/<name>/<timestamp>")
    seed: int | None = option(None, "random seed; chosen at random and written back when absent")
    steps: int = option(1000, "number of training steps", positive)
    batch_size: int = option(100, "mini-batch size", positive)
    device: str = option("auto", "auto (cuda when available), cpu, cuda, cuda:N or mps", _device)
    dtype: Literal["float32", "float64"] = option("float32", "dtype of parameters and data")
    precision: Literal["fp32", "bf16", "fp16"] = option(
        "fp32",
        "autocast precision of training steps (bf16, fp16 with a gradient scaler) for estimators that declare it safe",
    )
    threads: int = option(
        0, "CPU threads for torch; 0 keeps torch's default (1 is fastest for small models)", non_negative
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
            node = node.setdefault(key, {})
        else:
            raise ConfigError(where, None, f"override '{override}': not a section")
    if not isinstance(node, dict):
        raise ConfigError(".".join(keys[:-1]), keys[-1], f"override '{override}': not a section")
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


def validate(raw: dict[str, Any], path: str, plugins: Loaded | None = None) -> Recipe:
    """Check every section of a parsed recipe against the registries; raise ConfigError."""
    plugins = plugins or load()
    try:
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
    """Parse a TOML file; missing files and syntax errors become ConfigError."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError("", None, "recipe file not found", file=str(path)) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("", None, f"invalid TOML: {exc}", file=str(path)) from None


def load_recipe(path: str | Path, overrides: list[str] = (), plugins: Loaded | None = None) -> Recipe:
    """Read, override and validate a recipe file."""
    raw = read(path)
    try:
        for override in overrides:
            apply_override(raw, override)
    except ConfigError as exc:
        exc.file = str(path)
        raise
    return validate(raw, str(path), plugins)


def with_run(recipe: Recipe, **changes: Any) -> Recipe:
    """A copy of the recipe with [run] fields changed (e.g. the seed written back)."""
    return attrs.evolve(recipe, run=attrs.evolve(recipe.run, **changes))
