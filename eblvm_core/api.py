"""The Python API (``import eblvm``; docs/python.md): train from a recipe given as a file, as
TOML-ready data (a dict) or as a ``Recipe``, through the very code path of ``eblvm run``
(``session.run``: seeding, CPU threads, loggers, run directory, provenance, resume, Ctrl-C), and
load a saved run for interactive work (model, posterior, sampler, data, ``evaluate``,
``sample``) through that of ``eblvm eval`` and ``eblvm sample`` (``evaluate.load_run``).

Errors a user can fix are ``eblvm_core.errors.EblvmError``s, with the same one-line message the
command line prints; a misuse of the functions themselves (a recipe and ``resume`` both, or
neither) is a ValueError.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eblvm_core import checkpoint as ckpt
from eblvm_core.contracts import EvalResult
from eblvm_core.evaluate import LoadedRun, load_run
from eblvm_core.recipe import Recipe
from eblvm_core.rundir import METRICS, RECIPE, Provenance, find_run_dir
from eblvm_core.session import resolve_recipe
from eblvm_core.session import run as run_session

__all__ = ["LoadedRun", "Run", "load", "load_recipe", "train"]

RecipeLike = str | Path | Mapping[str, Any] | Recipe
Overrides = Sequence[str] | Mapping[str, Any]
Echo = Callable[[str], None] | None


def _quiet(_line: str) -> None:
    pass


def toml_value(value: Any) -> str:
    """A Python value as TOML text for an override (``1e-3``, ``"cosine"``, ``[64, 64]``,
    ``{ burn_in = 200 }``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (str, Path)):
        return json.dumps(str(value), ensure_ascii=False)  # a JSON string is a TOML basic string
    if isinstance(value, Mapping):
        return (
            "{ "
            + ", ".join(f"{json.dumps(str(k), ensure_ascii=False)} = {toml_value(v)}" for k, v in value.items())
            + " }"
        )
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"an override value must be a bool, number, string, list or dict, not {type(value).__name__}")


def override_list(overrides: Overrides | str) -> list[str]:
    """``-o`` style overrides from a list of ``"section.key=value"`` strings (one string is one
    override) or a mapping ``{"run.steps": 300, "optim.model.lr": 3e-3}``."""
    if isinstance(overrides, str):
        return [overrides]
    if isinstance(overrides, Mapping):
        return [f"{key}={toml_value(value)}" for key, value in overrides.items()]
    return [str(o) for o in overrides]


def load_recipe(recipe: RecipeLike, overrides: Overrides = ()) -> Recipe:
    """A validated ``Recipe`` from a path, TOML-ready data (a dict) or a ``Recipe``, with
    overrides: what ``train`` would train, checked as ``eblvm validate`` checks the recipe's
    values (``Recipe.to_dict()`` gives it back as data, every default filled in)."""
    return resolve_recipe(recipe, override_list(overrides))


class Run:
    """A run directory: the one ``train`` trained in, or ``Run(path)`` for any run directory (a
    run's name folder, ``runs/<name>``, gives its latest run).

    ``run_dir``: the directory; ``metrics``: the final evaluation (``{"eval/<name>/<key>":
    value}``, what ``eblvm run`` prints, read back from metrics.jsonl when not given);
    ``recipe``, ``status``, ``history()``, ``checkpoints()``; ``load()`` for the parts, and
    ``evaluate()``/``sample()`` on a checkpoint. ``echo`` gets the line that names the latest
    run of a name folder (None: nowhere).
    """

    def __init__(self, run_dir: str | Path, metrics: Mapping[str, float] | None = None, *, echo: Echo = print):
        self.run_dir, note = find_run_dir(run_dir)
        if note is not None and echo is not None:
            echo(note)
        self.metrics: dict[str, float] = dict(metrics) if metrics else self._final()

    def __repr__(self) -> str:
        return f"Run({str(self.run_dir)!r}, status={self.status!r})"

    def _final(self) -> dict[str, float]:
        """The last evaluation the training wrote (rows of ``eblvm eval`` left out)."""
        rows = [r for r in self.history() if "checkpoint" not in r and any(k.startswith("eval/") for k in r)]
        return {k: v for k, v in rows[-1].items() if k.startswith("eval/")} if rows else {}

    @property
    def recipe(self) -> Recipe:
        """The run's resolved recipe (recipe.toml: the seed and every default filled in)."""
        from eblvm_core.recipe import load_recipe as read

        return read(self.run_dir / RECIPE)

    @property
    def status(self) -> str | None:
        """How the run's last session ended (run.json): "finished", "stopped early", "interrupted",
        "diverged", "failed", "killed", or "running"."""
        return Provenance(self.run_dir).status

    def history(self) -> list[dict[str, Any]]:
        """Every row of metrics.jsonl: ``{"step": ..., "train/loss": ...}``, evaluations
        ``{"step": ..., "eval/<name>/<key>": ...}`` (with ``"checkpoint"`` for ``eblvm eval``'s)."""
        path = self.run_dir / METRICS
        if not path.exists():
            return []
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # a line cut by a kill
        return rows

    def checkpoints(self) -> list[str]:
        """The checkpoints one may load: ``step:N`` for each kept one ([run] keep_every), then
        ``best`` and ``last`` where they exist."""
        names = [f"step:{step}" for step in ckpt.kept_steps(self.run_dir)]
        names += ["best"] if ckpt.best_checkpoint(self.run_dir).exists() else []
        names += ["last"] if ckpt.last_checkpoint(self.run_dir).exists() else []
        return names

    def load(
        self,
        checkpoint: str = "last",
        *,
        device: str | None = None,
        overrides: Overrides = (),
        seed: int = 0,
        evaluators: Sequence[str | Mapping[str, Any]] | None = None,
        echo: Echo = print,
    ) -> LoadedRun:
        """``load(self.run_dir, ...)``."""
        return load(
            self.run_dir, checkpoint, device=device, overrides=overrides, seed=seed, evaluators=evaluators, echo=echo
        )

    def evaluate(
        self,
        checkpoint: str = "last",
        evaluators: Sequence[str | Mapping[str, Any]] | None = None,
        *,
        overrides: Overrides = (),
        device: str | None = None,
        seed: int = 0,
        record: bool = False,
        echo: Echo = print,
    ) -> EvalResult:
        """``eblvm eval`` from Python: load ``checkpoint`` and run the recipe's evaluators, or
        ``evaluators`` (names or [[eval]] tables; ``overrides`` such as ``{"eval.0.n_chains":
        500}`` then address them); with ``record`` the results are also appended to metrics.jsonl
        and logged to the run's [[log]] loggers, as the command does."""
        loaded = self.load(checkpoint, device=device, overrides=overrides, seed=seed, evaluators=evaluators, echo=echo)
        return loaded.evaluate(record=record, echo=echo)

    def sample(
        self,
        n: int = 64,
        checkpoint: str = "last",
        *,
        sampler: str | None = None,
        overrides: Overrides = (),
        device: str | None = None,
        seed: int = 0,
    ) -> Tensor:
        """``eblvm sample`` from Python: ``n`` samples (n, *event_shape) from ``checkpoint``,
        the raw samples the command writes for the same seed and overrides."""
        return self.load(checkpoint, device=device, overrides=overrides, seed=seed, echo=None).sample(n, sampler)


def _describe(recipe: RecipeLike | None, resume: str | Path | None, overrides: list[str]) -> str:
    """What run.json records as the command of a session started from Python."""
    if resume is not None:
        what = f"resume={str(resume)!r}"
    elif isinstance(recipe, Recipe):
        what = f"<Recipe from {recipe.path}>"
    elif isinstance(recipe, Mapping):
        what = "<recipe dict>"
    else:
        what = repr(str(recipe))
    extra = f", overrides={overrides!r}" if overrides else ""
    return f"eblvm.train({what}{extra}) in: {shlex.join(sys.argv)}"


def train(
    recipe: RecipeLike | None = None,
    *,
    overrides: Overrides = (),
    out: str | Path = "runs",
    resume: str | Path | None = None,
    device: str | None = None,
    echo: Echo = print,
) -> Run:
    """Train as ``eblvm run`` does, through the same code (``session.run``), and return the run.

    ``recipe``: a recipe file's path, TOML-ready data (a dict, as ``tomllib`` reads a recipe) or
    a ``Recipe``; or ``resume``: a run directory to continue (a run's name folder: its latest
    run), and no recipe. ``overrides``: ``["run.steps=300"]`` or ``{"run.steps": 300}``, as
    ``-o``. ``out``: the folder of run directories (``<out>/<name>/<timestamp>``); ``device``:
    as ``--device``; ``echo``: where the console lines go (None: nowhere).

    The same seed gives the same parameters to the bit as the command line: the recipe's seed
    (or one drawn and written into recipe.toml), the CPU threads of [run] threads (torch's
    setting is put back afterwards), the [[log]] loggers, checkpoints, run.json and run.log.
    Ctrl-C stops after the step with a checkpoint (``errors.Interrupted``); errors are
    ``EblvmError``s with the command line's message. ``echo`` gets every line ``eblvm run``
    prints, from the run directory to the final evaluation and ``done: <run_dir>``.
    """
    if (recipe is None) == (resume is None):
        raise ValueError("give a recipe or resume=RUN_DIR (one of them)")
    listed = override_list(overrides)
    threads = torch.get_num_threads()
    try:
        run_dir, results = run_session(
            recipe, listed, device, out, resume, echo or _quiet, command=_describe(recipe, resume, listed)
        )
    finally:
        torch.set_num_threads(threads)
    return Run(run_dir, results, echo=None)


def load(
    run_dir: str | Path,
    checkpoint: str = "last",
    *,
    device: str | None = None,
    overrides: Overrides = (),
    seed: int = 0,
    evaluators: Sequence[str | Mapping[str, Any]] | None = None,
    echo: Echo = print,
) -> LoadedRun:
    """A saved run rebuilt with a checkpoint loaded, as ``eblvm eval``/``sample`` load it.

    ``run_dir``: a run directory or a run's name folder (its latest run, named through
    ``echo``); ``checkpoint``: ``"last"``, ``"best"``, ``"step:N"`` (kept by [run] keep_every)
    or a file; ``evaluators`` replace the recipe's [[eval]] (names or tables) before
    ``overrides`` apply (``{"eval.0.n_chains": 500}``); ``seed`` seeds ``evaluate`` and
    ``sample``. The result has ``model``, ``posterior``, ``sampler``, ``data`` and ``parts``,
    with the EMA weights in place where a role keeps them, and ``evaluate()``/``sample(n)``.
    """
    tables = None if evaluators is None else [{"kind": e} if isinstance(e, str) else dict(e) for e in evaluators]
    return load_run(run_dir, checkpoint, device, override_list(overrides), seed, evals=tables, echo=echo or _quiet)
