"""A training session: the one path of ``eblvm run`` and ``eblvm.train``, from a request (a recipe,
or a run directory to resume) to the final evaluation. ``run`` reads top to bottom: the recipe,
the plan, then under the session's signal policy and process group: prepare (a new run and a
resumed one end with the same things: a locked run directory and the state to train), fit, close.

It locks the run directory, writes the resolved recipe and provenance, turns SIGINT and SIGTERM
into a checkpoint and a clean stop, and records how the session ended; nothing is written before
the recipe built and, on resume, the checkpoint loaded and fitted. Under torchrun every process
runs it; rank 0 alone writes (``Records``)."""

from __future__ import annotations

import contextlib
import copy
import secrets
import signal
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from eblvm_core import checkpoint as ckpt
from eblvm_core import distributed
from eblvm_core.build import build, check_loggers, plan_for
from eblvm_core.compiled import CompiledStep, compile_step
from eblvm_core.errors import ConfigError, DataError, EblvmError, Interrupted, TrainingDiverged
from eblvm_core.evaluation import AfterEvaluation
from eblvm_core.launching import RunRequest
from eblvm_core.plan import Launch, Plan, numerics
from eblvm_core.processes import resume_command
from eblvm_core.recipe import Recipe, check_unchanged, load_recipe, validate_with, with_run
from eblvm_core.records import Records, cannot_write, quiet
from eblvm_core.rundir import RECIPE, Provenance, RunLock, announce_run_dir, find_run_dir, new_run_dir
from eblvm_core.state import RunState
from eblvm_core.trainer import Trainer

DICT_RECIPE = "<recipe dict>"  # what errors name as the file of a recipe given as data
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # what makes training write a checkpoint and stop


def resolve_recipe(recipe: str | Path | Mapping[str, Any] | Recipe, overrides: Sequence[str] = ()) -> Recipe:
    """A validated recipe from a TOML file's path, TOML-ready data (a dict as ``tomllib`` reads a
    recipe, or ``Recipe.to_dict()`` gives) or a ``Recipe``, with ``-o`` style overrides applied;
    the same validation and errors as a file (data is named ``<recipe dict>``)."""
    if isinstance(recipe, (str, Path)):
        return load_recipe(recipe, list(overrides))
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
    request: RunRequest,
    echo: Callable[[str], None] = print,
    *,
    stop_signals: Sequence[int] = STOP_SIGNALS,
    launched_by: Mapping[str, Any] | None = None,
    after_evaluation: AfterEvaluation | None = None,
) -> tuple[Path, dict[str, float]]:
    """Train as ``request`` asks; returns (run_dir, final evaluation). ``echo`` gets every line
    of the console, ``eblvm run``'s and ``eblvm.train``'s alike: the run directory, the step and
    evaluation lines, the final evaluation (``name: value``, also in run.log) and last ``done:
    <run_dir>`` (rank 0 alone). On resume the overrides may change only ``recipe.RESUMABLE`` keys;
    they are checked, as is the checkpoint, before anything is written.

    For whoever starts sessions on someone's behalf (a cluster job, a search): ``stop_signals`` are
    the signals that make training write a checkpoint and stop (a cluster job adds the one its
    scheduler sends before a time limit); ``launched_by`` is recorded in run.json's session (e.g.
    ``{"kind": "slurm", "job_id": "812_3"}``); ``after_evaluation`` may end the run after an
    evaluation (``Trainer``; a search's pruner). Under torchrun every process calls it and joins
    the process group for the run; ranks > 0 return an empty evaluation."""
    launch = Launch.here()
    say = echo if launch.rank == 0 else quiet
    recipe, resume = _requested(request, say)
    check_loggers(recipe)
    plan = plan_for(recipe, launch=launch)
    signals_of = stop_on_signals(stop_signals, several=launch.world > 1)
    with signals_of as signals, distributed.process_group(plan.device), _Locks() as locks:
        prepared = _prepare(recipe, plan, request.out, resume, locks, say)
        if isinstance(prepared, str):  # nothing left to do
            assert resume is not None, "only a resumed run can have nothing left to do"
            say(prepared)
            return resume, {}
        recipe, run_dir, state, (compiled, step_line, how) = prepared
        records = Records(run_dir, say, writes=plan.rank == 0)
        trainer = Trainer(recipe, state, records, after_evaluation, compiled)
        how = how or ("CUDA graph" if plan.cuda_graph is None else f"eager: {plan.cuda_graph}")
        with numerics(plan) as threads:
            results = _fit(
                trainer, records, threads, resume is not None, request, launched_by, signals, (step_line, how)
            )
        say(f"done: {run_dir}")
        return run_dir, results


def _requested(request: RunRequest, say: Callable[[str], None]) -> tuple[Recipe, Path | None]:
    """(recipe, run directory to resume or None) of a request: a new run's recipe resolved, with a
    seed drawn when it has none; a resumed run's own recipe with the overrides a resume may take
    (checked here); either with the request's device."""
    if request.resume is None:
        recipe = resolve_recipe(request.recipe, request.overrides)
        if recipe.run.seed is None:
            recipe = with_run(recipe, seed=secrets.randbelow(2**31))
        resume = None
    else:
        resume, note = find_run_dir(request.resume, "cannot resume")
        if note is not None:
            say(note)
        recipe = load_recipe(resume / RECIPE, list(request.overrides))
        check_unchanged(load_recipe(resume / RECIPE), recipe, "when resuming")
    if request.device is not None:
        recipe = with_run(recipe, device=request.device)
    return recipe, resume


def _prepare(
    recipe: Recipe, plan: Plan, out: Path, resume: Path | None, locks: _Locks, say: Callable[[str], None]
) -> tuple[Recipe, Path, RunState, tuple[CompiledStep | None, str | None, str | None]] | str:
    """(recipe, locked run directory, state to train, ``compile_step``'s answer): a new run's
    directory is made, a resumed run's checkpoint is read, checked and restored (without one, it
    starts again from step 0 in its directory); the step is compiled where the plan says, before a
    directory is made. Every rank builds from the run's seed (rank 0's when it was drawn), then
    ranks > 0 reseed. A line instead when a resumed run has nothing left to do."""
    checkpoint = None
    if resume is None:
        if plan.world > 1:
            recipe = with_run(recipe, seed=distributed.broadcast_object(recipe.run.seed))
    else:
        checkpoint = _checked_resume(recipe, resume, locks)
        if isinstance(checkpoint, str):
            return checkpoint
    seed = recipe.run.seed
    assert seed is not None, "a session's recipe has its seed (chosen and written back when absent)"
    ckpt.seed_everything(seed)
    built = build(recipe, plan)
    if plan.device_note is not None:
        say(f"device auto: {plan.device_note}; training on the CPU")
    state = RunState(recipe, built)
    if plan.rank:
        ckpt.seed_everything(distributed.rank_seed(seed, plan.rank))
    if checkpoint is not None and resume is not None:
        state.restore(ckpt.to_device(checkpoint, plan.device), source=ckpt.last_checkpoint(resume))
    with numerics(plan):  # compiled with the threads and numerics it runs with
        compiled = compile_step(state, say) if plan.device.type == "cpu" else (None, None, None)
    run_dir = resume or Path(_on_rank0(lambda: locks.claim(new_run_dir(out, recipe.run.name))))
    if plan.rank == 0:
        announce_run_dir(run_dir)
    return recipe, run_dir, state, compiled


def _fit(
    trainer: Trainer,
    records: Records,
    threads: int,
    resumed: bool,
    request: RunRequest,
    launched_by: Mapping[str, Any] | None,
    signals: Signals,
    step: tuple[str | None, str],
) -> dict[str, float]:
    """Open the run's records, train, and close them with how the session ended: "finished",
    "stopped early" ([run] patience), another status a ``Stop`` of ``after_evaluation`` gave
    ("pruned"), "diverged", "interrupted" or "failed". ``step`` is (the log's line on how the
    training step runs, what run.json records of it)."""
    recipe, state, plan = trainer.recipe, trainer.state, trainer.state.built.plan
    run_dir = records.run_dir
    assert run_dir is not None, "a session's records are those of its run directory"
    step_line, how = step
    status = "failed"
    try:
        final_pending = resumed and (state.step == recipe.run.steps or state.out_of_patience())
        records.open(recipe, plan, state.step, threads, resumed, request.command, launched_by, final_pending, how)
        for warning in state.parts.warnings:
            records.echo(f"warning: {warning}")
        records.echo(_opening(recipe, state, run_dir, threads, resumed))
        if step_line is not None:
            records.echo(step_line)
        signals.watch(trainer)
        try:
            if plan.world > 1:
                trainer.stop_if_asked()  # a signal one rank had during the set-up stops every rank here
            results = trainer.fit()
        except KeyboardInterrupt:
            since = _kept(state) or "no checkpoint had been written, so it starts again from step 0"
            raise Interrupted(
                f"Ctrl-C at step {state.step}, stopped at once; resume with: "
                f"{resume_command(run_dir, plan.world)} ({since})"
            ) from None
        except (DataError, OSError) as exc:
            raise _mid_run(exc, run_dir, state) from None
        finally:
            signals.done()
        status = "finished" if trainer.stopped is None else trainer.stopped.status
        records.finish(recipe, results)
        return results
    except BaseException as exc:
        if isinstance(exc, (TrainingDiverged, Interrupted)):
            status = "diverged" if isinstance(exc, TrainingDiverged) else "interrupted"
        records.failed(exc)
        raise
    finally:
        records.close(status, state.step)


def _opening(recipe: Recipe, state: RunState, run_dir: Path, threads: int, resumed: bool) -> str:
    """The session's first line: where it resumes, or the new run's directory, seed and device."""
    if resumed and state.last_saved is None:
        return f"resuming {run_dir} at step 0: no checkpoint had been written, so it starts again"
    if resumed:
        return f"resuming {run_dir} at step {state.step}"
    device, world = state.built.plan.device, state.world
    threads_said = f", {threads} CPU thread{'s' * (threads > 1)}" if device.type == "cpu" or world > 1 else ""
    processes = f" per process, {world} processes" if world > 1 else ""
    return f"run directory: {run_dir}  (seed {recipe.run.seed}, device {device}{threads_said}{processes})"


def _mid_run(exc: DataError | OSError, run_dir: Path, state: RunState) -> EblvmError:
    """The one line of a file fault met while training: a data file that cannot be read (a
    DataError from its reader, or an OSError naming a file outside the run directory) as the read
    error it is, with where the run stands and how to resume once it is fixed; any other OSError as
    the run directory's write error (exit 1)."""
    kept = _kept(state) or "no checkpoint was written"
    filename = getattr(exc, "filename", None)
    if isinstance(exc, OSError) and (filename is None or Path(run_dir).resolve() in Path(filename).resolve().parents):
        return cannot_write(exc, run_dir, f"; {kept}")
    what = _own_line(exc) if isinstance(exc, DataError) else f"{filename}: cannot read: {exc.strerror or exc}"
    return DataError(f"{what}; {kept}; once it is fixed, resume with: {resume_command(run_dir, state.world)}")


def _own_line(exc: DataError) -> str:
    """A reader's DataError line, also when a DataLoader worker raised it: torch re-raises it in
    the main process with the worker's traceback before the line."""
    text = str(exc)
    if "in DataLoader worker process" in text:
        text = text.rsplit("DataError: ", 1)[-1].strip()
    return text


def _kept(state: RunState) -> str | None:
    """Which checkpoint holds the last saved step (None: none was written)."""
    return None if state.last_saved is None else f"{state.last_saved[1]} holds step {state.last_saved[0]}"


class _Locks:
    """The run-directory locks rank 0 holds for the session, released when it ends."""

    def __init__(self) -> None:
        self.held: list[RunLock] = []

    def claim(self, run_dir: Path) -> Path:
        self.held.append(RunLock(run_dir).acquire())
        return run_dir

    def __enter__(self) -> _Locks:
        return self

    def __exit__(self, *_exc: Any) -> None:
        for lock in self.held:
            lock.release()


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


def _checked_resume(recipe: Recipe, run_dir: Path, locks: _Locks) -> dict[str, Any] | str | None:
    """The checkpoint to continue from, read on the CPU: lock the run directory (rank 0), remove
    stale temporary checkpoints, load last.pt and check it against the recipe. None without a
    checkpoint (stopped before the first: the run starts again from step 0 in its directory); a
    line saying why nothing is left to do when the run ended at [run] steps, or stopped early and
    the patience is still spent."""
    path = ckpt.last_checkpoint(run_dir)
    loaded: dict[str, Any] = {}

    def check() -> tuple[int | None, bool, int]:
        locks.claim(run_dir)
        ckpt.remove_stale_temporaries(run_dir)
        if not path.exists():
            return None, False, 0
        loaded["state"] = ckpt.read_checkpoint(path)
        ckpt.check_checkpoint_recipe(loaded["state"], recipe, path)
        return int(loaded["state"]["step"]), Provenance(run_dir).finished, int(loaded["state"].get("stale", 0))

    step, finished, stale = _on_rank0(check)
    if step is None:
        return None
    if step > recipe.run.steps:
        error = ConfigError("run", "steps", f"{recipe.run.steps} is below the checkpoint's step {step}")
        recipe.blame(error)
        raise error
    if step == recipe.run.steps and finished:
        return (
            f"{run_dir} finished at step {step}: nothing to do "
            "(continue it with -o run.steps=N; evaluate it with eblvm eval)"
        )
    patience = recipe.run.patience
    if finished and patience is not None and stale >= patience:
        return (
            f"{run_dir} stopped early at step {step}: {stale} evaluations without improvement, "
            f"[run] patience = {patience}: nothing to do (continue it with a larger -o run.patience=N; "
            "evaluate it with eblvm eval)"
        )
    return loaded.get("state") or ckpt.read_checkpoint(path)


class Signals:
    """How a session answers its stop signals (SIGINT, SIGTERM and any others it was given) once
    training has started (``watch``): the first asks the trainer to finish its step, write a
    checkpoint and stop (``Trainer.stop_signal``); a second Ctrl-C aborts training at once
    (KeyboardInterrupt). Once training has ended, for whatever reason, they are ignored while the
    session shuts down (process group, logs, provenance), so a late Ctrl-C neither loses a record
    nor prints a traceback. Before training starts, Ctrl-C interrupts as usual and any other
    signal goes to the handler that was there before the session (``previous``), else does what
    it does by default (SIGTERM ends the process). Under ``several`` processes the first signal
    before training is kept (``pending``) instead: a rank that left its set-up alone would leave
    the others waiting at a collective, so ``watch`` hands it to the trainer, and the ranks agree
    on it before the first step (``Trainer.stop_if_asked``); a second Ctrl-C still aborts at once."""

    def __init__(self, several: bool = False) -> None:
        self.several = several
        self.pending: str | None = None
        self.trainer: Trainer | None = None
        self.training = False
        self.previous: dict[int, Any] = {}

    def watch(self, trainer: Trainer) -> None:
        self.trainer, self.training = trainer, True
        if self.pending is not None:
            trainer.stop_signal = self.pending

    def done(self) -> None:
        self.training = False

    def __call__(self, signum: int, _frame: Any) -> None:
        if self.trainer is None:  # not training yet: Ctrl-C interrupts the set-up as usual
            if self.several and self.pending is None:
                self.pending = signal.Signals(signum).name
                return
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
def stop_on_signals(signals: Sequence[int] = STOP_SIGNALS, several: bool = False) -> Iterator[Signals]:
    """The session's policy for ``signals`` (``Signals``, of ``several`` processes or one) within
    the block, the previous handlers after it. Outside the main thread signals are left alone (the
    policy then watches nothing)."""
    policy = Signals(several)
    if threading.current_thread() is not threading.main_thread():
        yield policy
        return
    policy.previous = {sig: signal.signal(sig, policy) for sig in dict.fromkeys(signals)}
    try:
        yield policy
    finally:
        for sig, old in policy.previous.items():
            signal.signal(sig, old)
