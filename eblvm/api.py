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
import os
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eblvm_core import checkpoint as ckpt
from eblvm_core import plugins
from eblvm_core.build import build
from eblvm_core.compiled import CompiledStep, compile_step
from eblvm_core.contracts import EvalResult
from eblvm_core.errors import EblvmError
from eblvm_core.evaluation import AfterEvaluation, Stop
from eblvm_core.launching import RunRequest
from eblvm_core.plan import numerics
from eblvm_core.recipe import Recipe, with_run
from eblvm_core.records import Records
from eblvm_core.rundir import METRICS, RECIPE, Provenance, find_run_dir
from eblvm_core.saved import LoadedRun, load_run
from eblvm_core.session import STOP_SIGNALS, resolve_recipe
from eblvm_core.session import run as run_session
from eblvm_core.state import RunState
from eblvm_core.trainer import Trainer

__all__ = ["LoadedRun", "Prepared", "Run", "Stop", "add_plugin", "load", "load_recipe", "prepare", "train"]

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
    after_evaluation: AfterEvaluation | None = None,
    stop_signals: Sequence[int] = STOP_SIGNALS,
    launched_by: Mapping[str, Any] | None = None,
    command: str | None = None,
) -> Run:
    """Train as ``eblvm run`` does, through the same code (``session.run``), and return the run.

    ``recipe``: a recipe file's path, TOML-ready data (a dict, as ``tomllib`` reads a recipe) or
    a ``Recipe``; or ``resume``: a run directory to continue (a run's name folder: its latest
    run), and no recipe. ``overrides``: ``["run.steps=300"]`` or ``{"run.steps": 300}``, as
    ``-o``. ``out``: the folder of run directories (``<out>/<name>/<timestamp>``); ``device``:
    as ``--device``; ``echo``: where the console lines go (None: nowhere).

    ``after_evaluation(step, scalars)`` is called after each evaluation during training; a
    ``Stop(status, why)`` it returns ends the run there (a search's pruner). For whoever trains on
    someone's behalf: ``stop_signals`` make training write a checkpoint and stop (default SIGINT
    and SIGTERM; a cluster job adds its scheduler's); ``launched_by`` is recorded in run.json's
    session; ``command`` is what run.json records as having started it (default: this call).

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
    request = RunRequest(recipe, listed, resume, device, out, command or _describe(recipe, resume, listed))
    threads = torch.get_num_threads()
    try:
        run_dir, results = run_session(
            request,
            echo or _quiet,
            stop_signals=stop_signals,
            launched_by=launched_by,
            after_evaluation=after_evaluation,
        )
    finally:
        torch.set_num_threads(threads)
    return Run(run_dir, results, echo=None)


class Prepared:
    """A recipe built as ``eblvm run`` builds it, nothing written (``prepare``): its ``recipe``,
    ``plan``, ``parts``, ``roles``, ``state`` (the step, the data stream, selection) and
    ``trainer``. ``step()`` takes one training step exactly as the training loop does (the rates,
    the batch, the precision, the compiled step or the CUDA graph where the plan uses one, the
    averages); ``restore``
    puts a checkpoint's state back; ``fit(run_dir)`` trains to [run] steps writing its records
    (recipe.toml, run.json, run.log, metrics.jsonl, checkpoints) into ``run_dir``."""

    def __init__(self, recipe: Recipe, echo: Echo = print):
        self.recipe = recipe
        ckpt.seed_everything(recipe.run.seed or 0)
        built = build(recipe)
        self.plan, self.parts, self.roles = built.plan, built.parts, built.roles
        self.state = RunState(recipe, built)
        self.echo = echo or _quiet
        with numerics(self.plan):
            cpu = self.plan.device.type == "cpu"
            compiled, line, _how = compile_step(self.state, self.echo) if cpu else (None, None, None)
        self.compiled: CompiledStep | None = compiled
        if line is not None:
            self.echo(line)
        self.trainer = Trainer(recipe, self.state, estimator_step=self.compiled)

    def step(self) -> dict[str, Any]:
        """One training step as the loop takes it; returns its metrics (0-d tensors or numbers)."""
        return self.trainer.step()

    def restore(self, checkpoint: str | Path) -> None:
        """Load a checkpoint file (networks, roles, data position, RNG, selection) into the state."""
        state = ckpt.read_checkpoint(checkpoint, map_location=self.plan.device)
        self.state.restore(state, source=checkpoint)

    def fit(self, run_dir: str | Path) -> dict[str, float]:
        """Train to [run] steps in ``run_dir`` (made if absent) and return the final evaluation."""
        run_dir = Path(run_dir)
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        records = Records(run_dir, self.echo)
        trainer = Trainer(self.recipe, self.state, records, estimator_step=self.compiled)
        status = "failed"
        with numerics(self.plan) as threads:
            records.open(self.recipe, self.plan, self.state.step, threads, False, None, None, False)
            try:
                results = trainer.fit()
                status = "finished"
                records.finish(self.recipe, results)
                return results
            finally:
                records.close(status, self.state.step)


def prepare(
    recipe: RecipeLike, *, overrides: Overrides = (), device: str | None = None, echo: Echo = print
) -> Prepared:
    """``recipe`` (a path, TOML-ready data or a ``Recipe``, with ``overrides``; ``device`` instead of
    the recipe's) built as ``eblvm run`` builds it, from its seed (0 when it has none), ready to
    step or fit: for benchmarks and studies that time or vary the training step itself."""
    resolved = resolve_recipe(recipe, override_list(overrides))
    if device is not None:
        resolved = with_run(resolved, device=device)
    return Prepared(resolved, echo)


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


def add_plugin(module: str) -> None:
    """Load ``module`` as a plugin in this process, as ``EBLVM_PLUGIN_MODULES`` does at start-up:
    its hooks register their components beside the installed plugins', so recipes trained or
    loaded afterwards may name them. ``"__main__"`` is the running script or, in a notebook, the
    kernel's namespace: hook functions defined in the notebook itself.

    The name is added to ``EBLVM_PLUGIN_MODULES`` (once; processes started from here inherit it)
    and the plugins are loaded again. A module that fails to import or register (a name another
    plugin has, an unknown hook) is an ``EblvmError`` saying why, and is taken out again, leaving
    the plugins as they were. An imported module is not re-imported: after editing a module's
    file, ``importlib.reload`` it first.
    """
    listed = [m.strip() for m in os.environ.get("EBLVM_PLUGIN_MODULES", "").split(",") if m.strip()]
    before = os.environ.get("EBLVM_PLUGIN_MODULES")
    if module not in listed:
        os.environ["EBLVM_PLUGIN_MODULES"] = ",".join([*listed, module])
    why = plugins.load(force=True, warn=False).failed.get(module)
    if why is not None:
        if before is None:
            os.environ.pop("EBLVM_PLUGIN_MODULES", None)
        else:
            os.environ["EBLVM_PLUGIN_MODULES"] = before
        plugins.load(force=True, warn=False)
        raise EblvmError(f"plugin '{module}' failed to load: {why}")
