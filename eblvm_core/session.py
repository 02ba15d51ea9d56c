"""A training session on a run directory: a new run or the continuation of one, from the recipe
(a file, TOML-ready data or a ``Recipe``: ``eblvm run`` and ``eblvm.train`` take this one path)
to the final evaluation. It locks the directory, writes the resolved recipe and provenance,
turns SIGINT and SIGTERM into a checkpoint and a clean stop, and records how the session ended;
nothing is written before the recipe built and, on resume, the checkpoint loaded and fitted.
Under torchrun every process runs it; rank 0 alone writes."""

from __future__ import annotations

import contextlib
import copy
import secrets
import shutil
import signal
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from eblvm_core import checkpoint as ckpt
from eblvm_core import distributed
from eblvm_core.build import build, build_loggers, check_loggers
from eblvm_core.context import RunContext, cudnn_autotuned, pick_device, quiet, set_threads, subnormals_flushed
from eblvm_core.contracts import Logger
from eblvm_core.errors import ConfigError, EblvmError, FileSystemError, Interrupted, TrainingDiverged
from eblvm_core.launch import resume_command
from eblvm_core.recipe import Recipe, check_unchanged, load_recipe, validate_with, with_run
from eblvm_core.rundir import (
    RECIPE,
    Provenance,
    RunLock,
    RunLog,
    announce_run_dir,
    clean_metrics,
    find_run_dir,
    hyperparameters,
    new_run_dir,
    write_recipe,
)
from eblvm_core.state import RunState
from eblvm_core.trainer import AfterEvaluation, Trainer

DICT_RECIPE = "<recipe dict>"  # what errors name as the file of a recipe given as data
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # what makes training write a checkpoint and stop


def resolve_recipe(recipe: str | Path | Mapping[str, Any] | Recipe, overrides: list[str] = ()) -> Recipe:
    """A validated recipe from a TOML file's path, TOML-ready data (a dict as ``tomllib`` reads a
    recipe, or ``Recipe.to_dict()`` gives) or a ``Recipe``, with ``-o`` style overrides applied;
    the same validation and errors as a file (data is named ``<recipe dict>``)."""
    if isinstance(recipe, (str, Path)):
        return load_recipe(recipe, overrides)
    if isinstance(recipe, Recipe):
        if not overrides:
            return recipe
        raw, path = recipe.to_dict(), recipe.path
        if not recipe.logs:
            raw["log"] = []  # to_dict leaves an empty [[log]] out, which would mean the default logger
    elif isinstance(recipe, Mapping):
        raw, path = copy.deepcopy(dict(recipe)), DICT_RECIPE
    else:
        raise TypeError(f"a recipe is a path, a dict or a Recipe, not {type(recipe).__name__}")
    return validate_with(raw, path, overrides)


def run(
    recipe_path: str | Path | Mapping[str, Any] | Recipe | None,
    overrides: list[str] = (),
    device: str | None = None,
    out: str | Path = "runs",
    resume: str | Path | None = None,
    echo: Callable[[str], None] = print,
    command: str | None = None,
    *,
    stop_signals: Sequence[int] = STOP_SIGNALS,
    launcher: Mapping[str, Any] | None = None,
    after_evaluation: AfterEvaluation | None = None,
) -> tuple[Path, dict[str, float]]:
    """Train from a recipe (a path, TOML-ready data or a ``Recipe``: ``resolve_recipe``) or
    continue the run in ``resume`` (a run directory, or a run's name folder: its latest run, said
    through ``echo``); returns (run_dir, final eval). ``command`` is what run.json records as
    having started the session (default: the command line).

    ``echo`` gets every line of the console, ``eblvm run``'s and ``eblvm.train``'s alike: the
    run directory, the step and evaluation lines, the final evaluation (``name: value``, also
    written to run.log) and last ``done: <run_dir>`` (rank 0 alone).

    On resume the overrides may change only ``recipe.RESUMABLE`` keys (steps, patience,
    intervals, device, threads, data root, evaluators, loggers); they are checked, as is the
    checkpoint, before anything is written.

    For whoever starts sessions on someone's behalf (a cluster job, a search): ``stop_signals``
    are the signals that make training write a checkpoint and stop (``Signals``; a cluster job adds
    the one its scheduler sends before a time limit); ``launcher`` is recorded in run.json's
    session as how it was launched (e.g. ``{"kind": "slurm", "job_id": "812_3"}``);
    ``after_evaluation`` may end the run after an evaluation (``Trainer``; a search's pruner).

    Under torchrun every process calls it and joins the
    process group for the run; ranks > 0 return an empty evaluation. On a CPU, subnormal floats
    are flushed to zero while it trains and evaluates (``context.subnormals_flushed``).
    """
    if resume is not None:
        run_dir, note = find_run_dir(resume, "cannot resume")
        if note is not None and distributed.rank() == 0:
            echo(note)
        resume = run_dir
        recipe_file = run_dir / RECIPE
        recipe = load_recipe(recipe_file, overrides)
        check_unchanged(load_recipe(recipe_file), recipe, "when resuming")
    else:
        recipe = resolve_recipe(recipe_path, overrides)
        if recipe.run.seed is None:
            recipe = with_run(recipe, seed=secrets.randbelow(2**31))
    if device is not None:
        recipe = with_run(recipe, device=device)
    check_loggers(recipe)
    try:
        torch_device = pick_device(recipe.run.device)
    except ConfigError as exc:
        recipe.blame(exc)
        raise
    with stop_on_signals(stop_signals) as signals, distributed.process_group(torch_device) as torch_device:
        started = Started(command, launcher, after_evaluation)
        run_dir, results = _train(recipe, torch_device, out, resume, echo, signals, started)
        if distributed.rank() == 0:
            echo(f"done: {run_dir}")
        return run_dir, results


@attrs.frozen
class Started:
    """What the caller of ``run`` says about the session besides the recipe: the command that
    started it, how it was launched (run.json) and who watches its evaluations (``Trainer``)."""

    command: str | None = None
    launcher: Mapping[str, Any] | None = None
    after_evaluation: AfterEvaluation | None = None


class Signals:
    """How a session answers its stop signals (SIGINT, SIGTERM and any others it was given) once
    training has started (``watch``): the first asks the trainer to finish its step, write a
    checkpoint and stop (``Trainer.stop_signal``); a second Ctrl-C aborts training at once
    (KeyboardInterrupt). Once training has ended, for whatever reason, they are ignored while the
    session shuts down (process group, logs, provenance), so a late Ctrl-C neither loses a record
    nor prints a traceback. Before training starts, Ctrl-C interrupts as usual and any other
    signal goes to the handler that was there before the session (``previous``), else does what
    it does by default (SIGTERM ends the process)."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.training = False
        self.previous: dict[int, Any] = {}

    def watch(self, trainer: Trainer) -> None:
        self.trainer, self.training = trainer, True

    def done(self) -> None:
        self.training = False

    def __call__(self, signum: int, _frame: Any) -> None:
        if self.trainer is None:  # not training yet: Ctrl-C interrupts the set-up as usual
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            before = self.previous.get(signum)
            if callable(before):  # e.g. a cluster job's own handler (requeue)
                before(signum, _frame)
                return
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        if not self.training:
            return
        if self.trainer.stop_signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.trainer.stop_signal = signal.Signals(signum).name


@contextlib.contextmanager
def stop_on_signals(signals: Sequence[int] = STOP_SIGNALS) -> Iterator[Signals]:
    """The session's policy for ``signals`` (``Signals``) within the block, the previous handlers
    after it. Outside the main thread signals are left alone (the policy then watches nothing)."""
    policy = Signals()
    if threading.current_thread() is not threading.main_thread():
        yield policy
        return
    policy.previous = {sig: signal.signal(sig, policy) for sig in dict.fromkeys(signals)}
    try:
        yield policy
    finally:
        for sig, old in policy.previous.items():
            signal.signal(sig, old)


def _on_rank0(work: Callable[[], Any]) -> Any:
    """Run ``work`` on rank 0 and hand its result, or its EblvmError, to every rank (so that a
    refusal on rank 0 stops every rank instead of leaving them waiting at a collective)."""
    outcome: Any = None
    if distributed.rank() == 0:
        try:
            outcome = ("ok", work())
        except EblvmError as exc:
            outcome = ("error", exc)
    outcome = distributed.broadcast_object(outcome)
    if outcome[0] == "error":
        raise outcome[1]
    return outcome[1]


def _train(
    recipe: Recipe,
    device: torch.device,
    out: str | Path,
    resume: str | Path | None,
    echo: Callable[[str], None],
    signals: Signals,
    started: Started,
) -> tuple[Path, dict[str, float]]:
    """``run`` once the recipe and this rank's device are known. Every rank builds from the run's
    seed (rank 0's when it was drawn), then ranks > 0 reseed; rank 0 alone locks and writes the run
    directory and echoes. Nothing is written before the recipe built and, on resume, the
    checkpoint loaded and fitted."""
    rank, world = distributed.rank(), distributed.world_size()
    if rank:
        echo = quiet
    if world > 1 and resume is None:
        recipe = with_run(recipe, seed=distributed.broadcast_object(recipe.run.seed))
    locks: list[RunLock] = []
    try:
        checkpoint = None
        if resume is not None:
            run_dir = Path(resume)
            checkpoint, finished = _checked_resume(recipe, run_dir, device, locks)
            if finished is not None:
                echo(finished)
                return run_dir, {}
        ckpt.seed_everything(recipe.run.seed)
        built = build(recipe, device, auto=recipe.run.device == "auto" and world == 1)
        if built.cpu_because is not None:
            echo(f"device auto: {built.cpu_because}; training on the CPU")
            checkpoint = ckpt.to_device(checkpoint, built.device)
        threads = set_threads(recipe.run.threads, built.device, built.parts)
        state = RunState(recipe, built, rank, world)
        if rank:
            ckpt.seed_everything(distributed.rank_seed(recipe.run.seed, rank))
        if checkpoint is not None:
            state.restore(checkpoint, source=ckpt.last_checkpoint(resume))
            del checkpoint
        if resume is None:
            run_dir = Path(_on_rank0(lambda: _new_run_dir(out, recipe.run.name, locks)))
        if rank == 0:
            announce_run_dir(run_dir)
        with subnormals_flushed(built.device), cudnn_autotuned(built.device, recipe.run.cudnn_benchmark):
            return _fit(recipe, state, run_dir, threads, resume, echo, signals, started)
    finally:
        for lock in locks:
            lock.release()


def _checked_resume(
    recipe: Recipe, run_dir: Path, device: torch.device, locks: list[RunLock]
) -> tuple[dict[str, Any] | None, str | None]:
    """(checkpoint, finished) of the run to continue: lock the run directory (rank 0, the lock
    goes into ``locks``), remove stale temporary checkpoints, load last.pt and check it against
    the recipe. Without a checkpoint (stopped before the first) the state is None and the run
    starts again from step 0 in its directory; ``finished`` is a line saying why nothing is left
    to do (the run ended at [run] steps, or stopped early and the patience is still spent), else
    None."""
    path = ckpt.last_checkpoint(run_dir)
    loaded: dict[str, Any] = {}

    def check() -> tuple[int | None, bool, int]:
        locks.append(RunLock(run_dir).acquire())
        ckpt.remove_stale_temporaries(run_dir)
        if not path.exists():
            return None, False, 0
        loaded["state"] = ckpt.read_checkpoint(path, map_location=device)
        ckpt.check_checkpoint_recipe(loaded["state"], recipe, path)
        return int(loaded["state"]["step"]), Provenance(run_dir).finished, int(loaded["state"].get("stale", 0))

    step, finished, stale = _on_rank0(check)
    if step is None:
        return None, None
    if step > recipe.run.steps:
        error = ConfigError("run", "steps", f"{recipe.run.steps} is below the checkpoint's step {step}")
        recipe.blame(error)
        raise error
    if step == recipe.run.steps and finished:
        return None, (
            f"{run_dir} finished at step {step}: nothing to do "
            "(continue it with -o run.steps=N; evaluate it with eblvm eval)"
        )
    patience = recipe.run.patience
    if finished and patience is not None and stale >= patience:
        return None, (
            f"{run_dir} stopped early at step {step}: {stale} evaluations without improvement, "
            f"[run] patience = {patience}: nothing to do (continue it with a larger -o run.patience=N; "
            "evaluate it with eblvm eval)"
        )
    state = loaded.get("state") or ckpt.read_checkpoint(path, map_location=device)
    return state, None


def _new_run_dir(out: str | Path, name: str, locks: list[RunLock]) -> Path:
    """Create and lock ``<out>/<name>/<timestamp>`` (the lock goes into ``locks``); a
    FileSystemError when ``out`` refuses."""
    run_dir = new_run_dir(out, name)
    locks.append(RunLock(run_dir).acquire())
    return run_dir


def _fit(
    recipe: Recipe,
    state: RunState,
    run_dir: Path,
    threads: int,
    resume: str | Path | None,
    echo: Callable[[str], None],
    signals: Signals,
    started: Started,
) -> tuple[Path, dict[str, float]]:
    """Write the run directory's recipe, provenance and log and make the loggers (rank 0), then
    the run's context and its trainer; train, and record how it ended: "finished", "stopped early"
    ([run] patience), another status a ``Stop`` of ``after_evaluation`` gave ("pruned"),
    "diverged", "interrupted" or "failed"."""
    rank, world, device = state.rank, state.world, state.parts.device
    provenance = Provenance(run_dir) if rank == 0 else None
    loggers: list[Logger] = []
    status = "failed"
    try:
        try:
            if rank == 0:
                write_recipe(recipe, run_dir)
                if resume is not None:  # the final evaluation runs again at the end, or at once if it stopped early
                    final_pending = state.step == recipe.run.steps or state.out_of_patience()
                    clean_metrics(run_dir, state.step, final_pending)
                provenance.start(str(device), world, state.step, threads, started.command, started.launcher)
                loggers = build_loggers(recipe, run_dir)
                if resume is not None:
                    for logger in loggers:
                        logger.resume(state.step)
        except BaseException as exc:
            if resume is None and rank == 0:
                shutil.rmtree(run_dir, ignore_errors=True)  # a run that could not start leaves nothing
                with contextlib.suppress(OSError):
                    run_dir.parent.rmdir()  # nor an empty <out>/<name>/
            if isinstance(exc, OSError):
                raise FileSystemError(f"{exc.filename or run_dir}: cannot write: {exc.strerror or exc}") from None
            raise
        log = RunLog(run_dir, echo) if rank == 0 else quiet
        context = RunContext(run_dir, device, threads, log, tuple(loggers), rank, world)
        trainer = Trainer(recipe, state, context, started.after_evaluation)
        for warning in state.parts.warnings:
            log(f"warning: {warning}")
        if resume is not None and state.last_saved is None:
            log(f"resuming {run_dir} at step 0: no checkpoint had been written, so it starts again")
        elif resume is not None:
            log(f"resuming {run_dir} at step {state.step}")
        else:
            threads_said = f", {threads} CPU thread{'s' * (threads > 1)}" if device.type == "cpu" or world > 1 else ""
            processes = f" per process, {world} processes" if world > 1 else ""
            log(f"run directory: {run_dir}  (seed {recipe.run.seed}, device {device}{threads_said}{processes})")
        signals.watch(trainer)
        try:
            results = trainer.fit()
        except KeyboardInterrupt:
            since = (
                f"{state.last_saved[1]} holds step {state.last_saved[0]}"
                if state.last_saved
                else "no checkpoint had been written, so it starts again from step 0"
            )
            raise Interrupted(
                f"Ctrl-C at step {state.step}, stopped at once; resume with: {resume_command(run_dir, world)} ({since})"
            ) from None
        except OSError as exc:
            raise FileSystemError(
                f"{exc.filename or run_dir}: cannot write: {exc.strerror or exc}; {_kept(state)}"
            ) from None
        finally:
            signals.done()
        status = "finished" if trainer.stopped is None else trainer.stopped.status
        if rank == 0:
            for key, value in results.items():
                log(f"{key.removeprefix('eval/')}: {value:.6g}")
            for logger in loggers:
                if hasattr(logger, "log_hparams"):
                    logger.log_hparams(hyperparameters(recipe), results)
        return run_dir, results
    except BaseException as exc:
        if isinstance(exc, TrainingDiverged):
            status = "diverged"
        elif isinstance(exc, Interrupted):
            status = "interrupted"
        if rank == 0 and isinstance(exc, EblvmError):
            label = "interrupted" if isinstance(exc, Interrupted) else "error"
            with contextlib.suppress(OSError):
                RunLog(run_dir, quiet).write(f"{label}: {exc}")
        raise
    finally:
        for logger in loggers:
            with contextlib.suppress(Exception):
                logger.close()
        if provenance is not None:
            with contextlib.suppress(OSError):
                provenance.end(status, state.step)


def _kept(state: RunState) -> str:
    if state.last_saved is None:
        return "no checkpoint was written"
    return f"{state.last_saved[1]} holds step {state.last_saved[0]}"
