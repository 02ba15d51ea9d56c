"""A training session on a run directory: a new run or the continuation of one, from the recipe
to the final evaluation. It locks the directory, writes the resolved recipe and provenance,
turns SIGINT and SIGTERM into a checkpoint and a clean stop, and records how the session ended;
nothing is written before the recipe built and, on resume, the checkpoint loaded and fitted.
Under torchrun every process runs it; rank 0 alone writes."""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from eblvm_core import checkpoint as ckpt
from eblvm_core import distributed
from eblvm_core.build import Built, auto_on_cpu, build, build_loggers, pick_device, set_threads
from eblvm_core.errors import ConfigError, EblvmError, FileSystemError, Interrupted, TrainingDiverged
from eblvm_core.launch import resume_command
from eblvm_core.recipe import Recipe, check_unchanged, load_recipe, with_run
from eblvm_core.rundir import (
    RECIPE,
    Provenance,
    RunLock,
    RunLog,
    announce_run_dir,
    clean_metrics,
    new_run_dir,
    write_recipe,
)
from eblvm_core.trainer import Trainer


def run(
    recipe_path: str | Path | None,
    overrides: list[str] = (),
    device: str | None = None,
    out: str | Path = "runs",
    resume: str | Path | None = None,
    echo: Callable[[str], None] = print,
) -> tuple[Path, dict[str, float]]:
    """Train from a recipe (or continue the run in ``resume``); returns (run_dir, final eval).

    On resume the overrides may change only ``recipe.RESUMABLE`` keys (steps, intervals, device,
    threads, data root, evaluators, loggers); they are checked, as is the checkpoint, before
    anything is written. Under torchrun every process calls it and joins the process group for
    the run; ranks > 0 return an empty evaluation.
    """
    if resume is not None:
        run_dir = Path(resume)
        recipe_file = run_dir / RECIPE
        if not recipe_file.is_file():
            what = "no such directory" if not run_dir.exists() else f"not a run directory: it has no {RECIPE}"
            raise ConfigError("", None, f"cannot resume: {what}", file=str(run_dir))
        recipe = load_recipe(recipe_file, overrides)
        check_unchanged(load_recipe(recipe_file), recipe, "when resuming")
    else:
        recipe = load_recipe(recipe_path, overrides)
        if recipe.run.seed is None:
            recipe = with_run(recipe, seed=secrets.randbelow(2**31))
    if device is not None:
        recipe = with_run(recipe, device=device)
    try:
        torch_device = pick_device(recipe.run.device)
    except ConfigError as exc:
        exc.file = exc.file or recipe.path
        raise
    with stop_on_signals() as signals, distributed.process_group(torch_device) as torch_device:
        return _train(recipe, torch_device, out, resume, echo, signals)


class Signals:
    """How a session answers SIGINT and SIGTERM once training has started (``watch``): the first
    asks the trainer to finish its step, write a checkpoint and stop (``Trainer.stop_signal``); a
    second Ctrl-C aborts training at once (KeyboardInterrupt). Once training has ended, for
    whatever reason, both are ignored while the session shuts down (process group, logs,
    provenance), so a late Ctrl-C neither loses a record nor prints a traceback."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.training = False

    def watch(self, trainer: Trainer) -> None:
        self.trainer, self.training = trainer, True

    def done(self) -> None:
        self.training = False

    def __call__(self, signum: int, _frame: Any) -> None:
        if self.trainer is None:  # not training yet: Ctrl-C interrupts the set-up as usual
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        if not self.training:
            return
        if self.trainer.stop_signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.trainer.stop_signal = signal.Signals(signum).name


@contextlib.contextmanager
def stop_on_signals() -> Iterator[Signals]:
    """The session's SIGINT/SIGTERM policy (``Signals``) within the block, the previous handlers
    after it. Outside the main thread signals are left alone (the policy then watches nothing)."""
    policy = Signals()
    if threading.current_thread() is not threading.main_thread():
        yield policy
        return
    previous = {sig: signal.signal(sig, policy) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield policy
    finally:
        for sig, old in previous.items():
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
) -> tuple[Path, dict[str, float]]:
    """``run`` once the recipe and this rank's device are known. Every rank builds from the run's
    seed (rank 0's when it was drawn), then ranks > 0 reseed; rank 0 alone locks and writes the run
    directory and echoes. Nothing is written before the recipe built and, on resume, the
    checkpoint loaded and fitted."""
    rank, world = distributed.rank(), distributed.world_size()
    if rank:
        echo = lambda _message: None  # noqa: E731
    if world > 1 and resume is None:
        recipe = with_run(recipe, seed=distributed.broadcast_object(recipe.run.seed))
    locks: list[RunLock] = []
    try:
        state = None
        if resume is not None:
            run_dir = Path(resume)
            state, finished = _checked_resume(recipe, run_dir, device, locks)
            if finished:
                echo(
                    f"{run_dir} finished at step {recipe.run.steps}: nothing to do "
                    "(continue it with -o run.steps=N; evaluate it with eblvm eval)"
                )
                return run_dir, {}
        ckpt.seed_everything(recipe.run.seed)
        built = build(recipe, device)
        why_cpu = auto_on_cpu(built, recipe, device) if recipe.run.device == "auto" and device.type == "cuda" else None
        if why_cpu is not None and not torch.distributed.is_initialized():  # torchrun keeps its GPUs
            echo(f"device auto: {why_cpu}; training on the CPU")
            device = torch.device("cpu")
            state = ckpt.to_device(state, device)
            ckpt.seed_everything(recipe.run.seed)
            built = build(recipe, device)
        threads = set_threads(recipe.run.threads, device, built.parts)
        trainer = Trainer(recipe, built, Path(resume or "."), echo)
        if rank:
            ckpt.seed_everything(distributed.rank_seed(recipe.run.seed, rank))
        if state is not None:
            trainer.restore(state, source=ckpt.last_checkpoint(resume))
            del state
        if resume is None:
            run_dir = Path(_on_rank0(lambda: _new_run_dir(out, recipe.run.name, locks)))
        if rank == 0:
            announce_run_dir(run_dir)
        trainer.run_dir = run_dir
        return _fit(recipe, trainer, built, run_dir, device, threads, resume, echo, signals)
    finally:
        for lock in locks:
            lock.release()


def _checked_resume(
    recipe: Recipe, run_dir: Path, device: torch.device, locks: list[RunLock]
) -> tuple[dict[str, Any] | None, bool]:
    """(checkpoint, finished) of the run to continue: lock the run directory (rank 0, the lock
    goes into ``locks``), remove stale temporary checkpoints, load last.pt and check it against
    the recipe. Without a checkpoint (stopped before the first) the state is None and the run
    starts again from step 0 in its directory; ``finished`` when nothing is left to do."""
    path = ckpt.last_checkpoint(run_dir)
    loaded: dict[str, Any] = {}

    def check() -> tuple[int | None, bool]:
        locks.append(RunLock(run_dir).acquire())
        ckpt.remove_stale_temporaries(run_dir)
        if not path.exists():
            return None, False
        loaded["state"] = ckpt.read_checkpoint(path, map_location=device, format=ckpt.CHECKPOINT_FORMAT)
        ckpt.check_checkpoint_recipe(loaded["state"], recipe, path)
        return int(loaded["state"]["step"]), Provenance(run_dir).finished

    step, finished = _on_rank0(check)
    if step is None:
        return None, False
    if step > recipe.run.steps:
        raise ConfigError("run", "steps", f"{recipe.run.steps} is below the checkpoint's step {step}", file=recipe.path)
    if step == recipe.run.steps and finished:
        return None, True
    state = loaded.get("state") or ckpt.read_checkpoint(path, map_location=device, format=ckpt.CHECKPOINT_FORMAT)
    return state, False


def _new_run_dir(out: str | Path, name: str, locks: list[RunLock]) -> Path:
    """Create and lock ``<out>/<name>/<timestamp>`` (the lock goes into ``locks``); a
    FileSystemError when ``out`` refuses."""
    run_dir = new_run_dir(out, name)
    locks.append(RunLock(run_dir).acquire())
    return run_dir


def _fit(
    recipe: Recipe,
    trainer: Trainer,
    built: Built,
    run_dir: Path,
    device: torch.device,
    threads: int,
    resume: str | Path | None,
    echo: Callable[[str], None],
    signals: Signals,
) -> tuple[Path, dict[str, float]]:
    """Write the run directory's recipe, provenance and log (rank 0), train, and record how it ended."""
    rank, world = trainer.rank, trainer.world
    log = RunLog(run_dir, echo) if rank == 0 else echo
    provenance = Provenance(run_dir) if rank == 0 else None
    status = "failed"
    try:
        try:
            if rank == 0:
                write_recipe(recipe, run_dir)
                if resume is not None:
                    clean_metrics(run_dir, trainer.step, trainer.step == recipe.run.steps)
                provenance.start(str(device), world, trainer.step, threads)
                built.loggers = build_loggers(recipe, run_dir)
                if resume is not None:
                    for logger in built.loggers:
                        logger.resume(trainer.step)
        except BaseException as exc:
            if resume is None and rank == 0:
                shutil.rmtree(run_dir, ignore_errors=True)  # a run that could not start leaves nothing
                with contextlib.suppress(OSError):
                    run_dir.parent.rmdir()  # nor an empty <out>/<name>/
            if isinstance(exc, OSError):
                raise FileSystemError(f"{exc.filename or run_dir}: cannot write: {exc.strerror or exc}") from None
            raise
        trainer.echo = log
        for warning in built.parts.warnings:
            log(f"warning: {warning}")
        if resume is not None and trainer.last_saved is None:
            log(f"resuming {run_dir} at step 0: no checkpoint had been written, so it starts again")
        elif resume is not None:
            log(f"resuming {run_dir} at step {trainer.step}")
        else:
            threads_said = f", {threads} CPU thread{'s' * (threads > 1)}" if device.type == "cpu" or world > 1 else ""
            processes = f" per process, {world} processes" if world > 1 else ""
            log(f"run directory: {run_dir}  (seed {recipe.run.seed}, device {device}{threads_said}{processes})")
        signals.watch(trainer)
        try:
            results = trainer.fit()
        except KeyboardInterrupt:
            since = (
                f"{trainer.last_saved[1]} holds step {trainer.last_saved[0]}"
                if trainer.last_saved
                else "no checkpoint had been written, so it starts again from step 0"
            )
            raise Interrupted(
                f"interrupted at step {trainer.step}; resume with: {resume_command(run_dir, world)} ({since})"
            ) from None
        except OSError as exc:
            raise FileSystemError(
                f"{exc.filename or run_dir}: cannot write: {exc.strerror or exc}; {_kept(trainer)}"
            ) from None
        finally:
            signals.done()
        status = "finished"
        if rank == 0:
            for key, value in results.items():
                log.write(f"{key.removeprefix('eval/')}: {value:.6g}")
            for logger in built.loggers:
                if hasattr(logger, "log_hparams"):
                    logger.log_hparams(hyperparameters(recipe), results)
        return run_dir, results
    except BaseException as exc:
        if isinstance(exc, TrainingDiverged):
            status = "diverged"
        elif isinstance(exc, Interrupted):
            status = "interrupted"
        if rank == 0 and isinstance(exc, EblvmError):
            with contextlib.suppress(OSError):
                log.write(f"error: {exc}")
        raise
    finally:
        for logger in built.loggers:
            with contextlib.suppress(Exception):
                logger.close()
        if provenance is not None:
            with contextlib.suppress(OSError):
                provenance.end(status, trainer.step)


def hyperparameters(recipe: Recipe) -> dict[str, float | int | str | bool]:
    """The resolved recipe but its [[eval]] and [[log]] lists, flattened to dotted keys
    (``"optim.model.lr": 0.001``, ``"optim.model.schedule.kind": "constant"``); lists become JSON text."""
    flat: dict[str, float | int | str | bool] = {}

    def walk(node: dict[str, Any], prefix: str) -> None:
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, name + ".")
            elif isinstance(value, (bool, int, float, str)):
                flat[name] = value
            elif value is not None:
                flat[name] = json.dumps(value)

    walk({k: v for k, v in recipe.to_dict().items() if k not in ("eval", "log")}, "")
    return flat


def _kept(trainer: Trainer) -> str:
    if trainer.last_saved is None:
        return "no checkpoint was written"
    return f"{trainer.last_saved[1]} holds step {trainer.last_saved[0]}"
