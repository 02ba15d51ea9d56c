"""What a validated recipe is: [run] (``RunConfig``), one ``Section`` per component (its registry
entry and validated config), one ``Role`` per [optim.<role>], and the ``Recipe`` holding them,
with the sections a recipe may have (from ``registry.KINDS``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import attrs
import cattrs

from eblvm_core.config import non_negative, option, positive
from eblvm_core.errors import ConfigError, blame
from eblvm_core.registry import KINDS, Entry, option_default

DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?|mps")
# One converter for every to_dict: a converter builds each class's unstructuring function on first
# use, so a new one per call cost 7 ms (every checkpoint writes the recipe).
_CONVERTER = cattrs.Converter()


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
    compile: bool | Literal["auto"] = option(
        "auto",
        "on a CPU, trace the training step into one graph and compile it (torch.compile): 'auto' where the step "
        "compiles and the run is long enough to repay it (docs/benchmarks.md), true (or stop saying why not), "
        "false (the eager step)",
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
REQUIRED = tuple(k.section for k in KINDS if k.required and k.section is not None)
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

    def reported_keys(self, evaluators: list[tuple[str, Any]] | None = None) -> set[str] | None:
        """The scalar keys the evaluators report (``eval/<name>/<key>``): each built evaluator's
        own ``reports`` where given (an ``Evaluator``), else its registration's keys at the
        section's options; None when one declares nothing (it is then checked when it reports)."""
        keys: set[str] = set()
        built = dict(enumerate(evaluators or []))
        for i, section in enumerate(self.evals):
            declared = getattr(built.get(i, (None, None))[1], "reports", None)
            declared = section.entry.reported_keys(section.config) if declared is None else declared
            if declared is None:
                return None
            keys.update(f"eval/{section.kind}/{key}" for key in declared)
        return keys

    def to_dict(self) -> dict[str, Any]:
        """The resolved recipe (defaults filled in), as TOML-ready data."""
        conv = _CONVERTER

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


def with_run(recipe: Recipe, **changes: Any) -> Recipe:
    """A copy of the recipe with [run] fields changed (e.g. the seed written back)."""
    return attrs.evolve(recipe, run=attrs.evolve(recipe.run, **changes))
