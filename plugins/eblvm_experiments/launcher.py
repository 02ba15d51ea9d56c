"""Runs as cluster jobs, through submitit (eblvm's ``slurm`` extra): ``--launcher slurm`` for
``eblvm run``, ``eblvm compare`` and ``eblvm search``; ``--launcher submitit-local`` runs the
same jobs as processes on this machine with submitit's local executor (a cluster set-up tried
on a laptop, and what the tests use).

- One run is one job. A run over several processes is one job whose tasks are its ranks (one per
  GPU, ``gpus`` per node, or ``nproc_per_node``): rank and world size come from Slurm's
  environment, exported as torchrun's (``submitit.helpers.TorchDistributedEnvironment``), and
  ``eblvm.train`` joins the process group as under torchrun. A comparison is one job array.
- A job told to stop (SIGTERM, or the USR2 Slurm sends ``signal_delay`` seconds before the time
  limit) finishes its step, writes its checkpoint as Ctrl-C does and is requeued by submitit
  (``Checkpointable``: ``checkpoint`` resubmits the job to resume its run directory); the
  requeued job continues the same run directory, so the run ends with the parameters an
  uninterrupted one would have (bit for bit on a CPU). A job restarted without that (a node
  failure) finds its run directory too: rank 0 names it in a file beside the jobs' logs.
- run.json records each session's launcher and job id.

The Slurm job's resources are a ``[launcher]`` table of a spec or the command line's options
(``SlurmConfig``, the one record of them: ``eblvm run --launcher slurm`` reads its flags through
the launchers registered here, ``compare`` and ``search`` through ``launcher_options``); submitit
writes its scripts, pickles and logs into ``folder`` (default: a ``slurm`` folder beside the
runs), which must be on a file system the nodes share.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from eblvm.plugin import (
    RUN_DIR_FILE,
    ConfigError,
    EblvmError,
    Interrupted,
    Launcher,
    RunRequest,
    non_negative,
    option,
    positive,
    structure,
)
from eblvm.tools import RECIPE

LAUNCHERS = ("local", "slurm", "submitit-local")
CLUSTERS = LAUNCHERS[1:]  # the launchers that go through submitit
TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")  # Slurm's [D-]H[:M[:S]] / M[:S] forms


def _time_limit(_inst: Any, _attribute: attrs.Attribute, value: int | str) -> None:
    """Validator: a time limit that ``minutes`` reads."""
    minutes(value)


@attrs.frozen
class SlurmConfig:
    """A ``[launcher]`` table: the resources of each Slurm job (and of submitit-local's processes)."""

    partition: str | None = option(None, "Slurm partition (default: the cluster's)")
    time: int | str = option(
        240,
        "time limit of one job: minutes, or as Slurm writes it (HH:MM:SS, D-HH:MM:SS); a run goes on in a requeued job",
        _time_limit,
    )
    nodes: int = option(1, "nodes per job (a run spans them: one rank per GPU on each)", positive)
    gpus: int = option(0, "GPUs per node; a run spans them, one process (rank) each", non_negative)
    nproc_per_node: int | None = option(None, "processes (ranks) per node; default: gpus, or 1", positive)
    cpus: int | None = option(None, "CPUs per process (Slurm's cpus-per-task; default: the cluster's)", positive)
    mem: str | None = option(None, "memory per node as Slurm writes it, e.g. '32G' (default: the cluster's)")
    array_parallelism: int = option(
        256, "jobs of a comparison's array (or a search's workers) that run at once", positive
    )
    signal_delay: int = option(
        120, "seconds before the time limit at which Slurm sends USR2: the run checkpoints and is requeued", positive
    )
    max_timeouts: int = option(
        10, "times a job may be requeued after reaching its time limit (preemptions do not count)", non_negative
    )
    sbatch: dict[str, Any] = option(
        {}, "further sbatch options, e.g. { account = 'proj', qos = 'high', constraint = 'a100' }; true for a bare flag"
    )
    setup: list[str] = option([], "shell lines the job script runs first (module load ..., source venv/bin/activate)")
    folder: str | None = option(
        None, "where submitit writes job scripts, pickles and logs (default: 'slurm' beside the runs)"
    )

    @property
    def minutes(self) -> int:
        return minutes(self.time)

    @property
    def tasks_per_node(self) -> int:
        return self.nproc_per_node or max(1, self.gpus)


def minutes(value: int | str) -> int:
    """A Slurm time limit in whole minutes (seconds round up): an int is minutes; a string is
    ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M`` or ``D-H:M:S``."""
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"must be at least one minute, got {value}")
        return value
    match = TIME.fullmatch(value.strip())
    if not match:
        raise ValueError(f"must be minutes or HH:MM:SS / D-HH:MM:SS, got {value!r}")
    days, first, b, c = (int(g) if g is not None else None for g in match.groups())
    a = first or 0  # the pattern's first number is never absent
    if days is not None:  # D-H[:M[:S]]
        seconds = ((days * 24 + a) * 60 + (b or 0)) * 60 + (c or 0)
    elif c is not None:  # H:M:S
        seconds = (a * 60 + (b or 0)) * 60 + c
    else:  # M[:S]
        seconds = a * 60 + (b or 0)
    if seconds < 60:
        raise ValueError(f"must be at least one minute, got {value!r}")
    return -(-seconds // 60)


def slurm_config(table: Mapping[str, Any], section: str = "launcher") -> SlurmConfig:
    """A validated ``[launcher]`` table (ConfigError naming the key, an ``sbatch`` entry by its own)."""
    config = structure(SlurmConfig, dict(table), section)
    for key, value in config.sbatch.items():
        if not isinstance(value, (str, int, float, bool)) or value is False:
            raise ConfigError(
                section, f"sbatch.{key}", f"must be a string, a number or true (a bare flag), got {value!r}"
            )
    return config


def with_options(config: SlurmConfig, options: Mapping[str, Any]) -> SlurmConfig:
    """``config`` with the command line's options (those given, not None) put over it; ``sbatch``
    entries add to the table's; a bad value is a ConfigError naming the option."""
    given = {k: v for k, v in options.items() if v is not None and v != [] and v != {}}
    table = attrs.asdict(config)
    sbatch = {**table["sbatch"], **given.pop("sbatch", {})}
    table.update(given, sbatch=sbatch)
    return slurm_config(table, "launcher (command line)")


# ---- submitit -------------------------------------------------------------------------------


def require_submitit(launcher: str) -> Any:
    """The submitit module, or a one-line error naming the extra that brings it."""
    try:
        import submitit
    except ImportError:
        from eblvm.tools import install_hint

        raise EblvmError(
            f"--launcher {launcher} needs submitit, eblvm's 'slurm' extra: {install_hint('slurm')}"
        ) from None
    return submitit


def executor(launcher: str, config: SlurmConfig, folder: Path, name: str) -> Any:
    """A submitit executor for ``launcher`` ('slurm' or 'submitit-local') with ``config``'s
    resources; job scripts, pickles and logs go to ``folder``."""
    submitit = require_submitit(launcher)
    folder.mkdir(parents=True, exist_ok=True)
    if launcher == "submitit-local":
        ex = submitit.LocalExecutor(folder, max_num_timeout=config.max_timeouts)
        ex.update_parameters(
            timeout_min=config.minutes,
            tasks_per_node=config.tasks_per_node,
            gpus_per_node=config.gpus,
            signal_delay_s=config.signal_delay,
        )
        return ex
    try:
        ex = submitit.SlurmExecutor(folder, max_num_timeout=config.max_timeouts)
    except RuntimeError:  # submitit looks for srun
        raise EblvmError(
            "--launcher slurm: no Slurm here (srun is not on the PATH); run it on the cluster's login node, "
            "or try the jobs on this machine with --launcher submitit-local"
        ) from None
    parameters = {
        "job_name": name,
        "partition": config.partition,
        "time": config.minutes,
        "nodes": config.nodes,
        "ntasks_per_node": config.tasks_per_node,
        "gpus_per_node": config.gpus or None,
        "cpus_per_task": config.cpus,
        "mem": config.mem,
        "signal_delay_s": config.signal_delay,
        "array_parallelism": config.array_parallelism,
        "setup": list(config.setup) or None,
        "additional_parameters": dict(config.sbatch) or None,
    }
    try:
        ex.update_parameters(**{k: v for k, v in parameters.items() if v is not None})
    except ValueError as exc:
        raise ConfigError("launcher", None, f"submitit refused the job's options: {exc}") from None
    return ex


def default_folder(config: SlurmConfig, beside: Path) -> Path:
    """Where submitit keeps the jobs: ``[launcher] folder``, else ``beside/slurm``."""
    return Path(config.folder) if config.folder else beside / "slurm"


def submit(ex: Any, jobs: list[Any]) -> list[Any]:
    """Submit ``jobs`` (callables) with executor ``ex``: one job alone, several as one job array
    (at most ``array_parallelism`` running at once)."""
    if len(jobs) == 1:
        return [ex.submit(jobs[0])]
    with ex.batch():
        handles = [ex.submit(job) for job in jobs]
    return handles


def reattach(record: Mapping[str, Any]) -> Any:
    """A handle on a job submitted earlier (``job_record``), or None when it cannot be watched."""
    try:
        import submitit
    except ImportError:
        return None
    kind = submitit.SlurmJob if record.get("launcher") == "slurm" else submitit.LocalJob
    try:
        return kind(folder=record["folder"], job_id=record["job_id"], tasks=list(range(record.get("tasks", 1))))
    except (KeyError, TypeError, ValueError, OSError):
        return None


def job_record(launcher: str, handle: Any, folder: Path, tasks: int) -> dict[str, Any]:
    """What a results folder keeps of a submitted job, to watch it again from a later command."""
    return {"launcher": launcher, "job_id": str(handle.job_id), "folder": str(folder), "tasks": tasks}


# ---- inside the job -------------------------------------------------------------------------


def cancelled(launcher: str, job_id: str) -> bool:
    """Whether Slurm says the job was cancelled (``scancel`` sends SIGTERM, as a preemption does:
    a cancelled job checkpoints but is not requeued). False when it cannot tell."""
    if launcher != "slurm":
        return False
    try:
        state = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return "CANCELLED" in state.stdout.upper()


def preempt_signal() -> int:
    """The signal submitit's jobs take as "checkpoint and requeue" (USR2, or $SUBMITIT_PREEMPT_SIGNAL)."""
    from submitit.core.job_environment import JobEnvironment

    return getattr(signal, f"SIG{JobEnvironment.USR_SIG}")


class Job:
    """One training session (or several, a search worker's trials) as a submitit job. In the job
    it takes rank and world size from the job's environment, records the launcher and job id in
    run.json, makes SIGTERM and submitit's preemption signal stop training with a checkpoint,
    and then asks submitit to requeue it: submitit calls the ``checkpoint`` method of a job that
    has one (its ``helpers.Checkpointable`` protocol) for the submission to requeue, here the
    same job resuming its run directory. Subclasses say what to train (``train``) and how a
    requeued job resumes (``resume_from``). Nothing here imports submitit before a job runs."""

    def __init__(self, launcher: str, folder: Path) -> None:
        self.launcher, self.folder = launcher, str(folder)
        self.token = uuid.uuid4().hex  # this job's own, kept through requeues
        self.resume: str | None = None

    @property
    def marker(self) -> Path:
        """Where rank 0 names the run directory it trains (``$EBLVM_RUN_DIR_FILE``, ``RUN_DIR_FILE``)."""
        return Path(self.folder) / "run_dirs" / self.token

    def __call__(self) -> Any:
        import submitit

        env = submitit.JobEnvironment()
        if env.num_tasks > 1:  # the job's tasks are a run's ranks, as torchrun's would be
            torch_env = submitit.helpers.TorchDistributedEnvironment()
            if "MASTER_PORT" not in os.environ:
                # rank 0's port, the same for every task: from the job id, below Linux's ephemeral ports
                # (32768-60999, where other connections live; submitit draws from 20000-60000)
                torch_env.master_port = 20000 + zlib.crc32(str(env.job_id).encode()) % 12000
            torch_env.export(set_cuda_visible_devices=False)
        self.marker.parent.mkdir(parents=True, exist_ok=True)
        os.environ[RUN_DIR_FILE] = str(self.marker)
        if self.resume is None:  # restarted without checkpoint() (a node failure): the run it began
            self.resume = self._announced()
        record: dict[str, Any] = {"kind": self.launcher, "job_id": str(env.job_id)}
        if os.environ.get("SLURM_RESTART_COUNT"):
            record["restarts"] = int(os.environ["SLURM_RESTART_COUNT"])
        preempt = preempt_signal()
        try:
            return self.train((signal.SIGINT, signal.SIGTERM, preempt), record)
        except Interrupted as exc:
            print(f"interrupted: {exc}", flush=True)
            requeue = signal.getsignal(preempt)  # submitit's own handler, put back by the session
            if not callable(requeue) or (str(exc).startswith("SIGTERM") and cancelled(self.launcher, env.job_id)):
                raise
            requeue(preempt, None)  # rank 0: checkpoint() and requeue, then exit; other ranks return
            raise SystemExit(0) from None  # ranks > 0: no result of their own; the job starts again

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """Called by submitit on rank 0 before it requeues the job: resume the run it trained."""
        from submitit.helpers import DelayedSubmission

        announced = self._announced()
        if announced is not None:
            self.resume_from(announced)
        return DelayedSubmission(self, *args, **kwargs)

    def _announced(self) -> str | None:
        with contextlib.suppress(OSError):
            path = self.marker.read_text().strip()
            if path and (Path(path) / RECIPE).is_file():
                return path
        return None

    def resume_from(self, run_dir: str) -> None:
        """Make the job resume ``run_dir`` when it starts (again)."""
        self.resume = run_dir

    def train(self, stop_signals: tuple[int, ...], launched_by: dict[str, Any]) -> Any:
        """Train what the job is for, stopping on ``stop_signals``; ``launched_by`` goes into run.json."""
        raise NotImplementedError


class RunJob(Job):
    """``eblvm run --launcher``: one run, from a recipe (TOML-ready data, resolved when it was
    submitted) or resuming a run directory (with ``overrides`` of the keys a resume may change,
    for its first session; a requeued job's run directory holds them); returns {run_dir, final}."""

    def __init__(
        self,
        launcher: str,
        folder: Path,
        recipe: dict[str, Any] | None,
        device: str | None,
        out: str,
        command: str,
        resume: str | None = None,
        overrides: Sequence[str] = (),
    ) -> None:
        super().__init__(launcher, folder)
        self.recipe, self.device, self.out, self.command = recipe, device, out, command
        self.resume, self.overrides = resume, list(overrides)

    def resume_from(self, run_dir: str) -> None:
        if run_dir != self.resume:
            self.overrides = []  # the run directory's recipe.toml holds them now
        super().resume_from(run_dir)

    def train(self, stop_signals: tuple[int, ...], launched_by: dict[str, Any]) -> dict[str, Any]:
        import eblvm

        run = eblvm.train(
            None if self.resume else self.recipe,
            overrides=self.overrides if self.resume else [],
            out=self.out,
            resume=self.resume,
            device=self.device,
            echo=lambda line: print(line, flush=True),
            stop_signals=stop_signals,
            launched_by=launched_by,
            command=self.command,
        )
        return {"run_dir": str(run.run_dir), "final": run.metrics}


# ---- watching -------------------------------------------------------------------------------

RUNNING = {"RUNNING", "COMPLETING", "STAGE_OUT", "SUSPENDED", "RESIZING", "SIGNALING"}


def job_state(handle: Any) -> str:
    """queued, running, finished or failed."""
    if handle.done():
        return "failed" if _error(handle) is not None else "finished"
    state = str(handle.state).split()[0].upper()
    return "running" if state in RUNNING else "queued"


def _error(handle: Any) -> str | None:
    """The last line of a finished job's error (None when it succeeded), and where its log is."""
    try:
        exc = handle.exception()
    except Exception as error:  # noqa: BLE001 - submitit's own failures to read a result
        exc = error
    if exc is None:
        return None
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    rules = [i for i, line in enumerate(lines) if set(line) == {"-"}]
    if len(rules) >= 2:  # submitit's "failed during processing with trace:" ---- traceback ---- "check the logs"
        lines = lines[rules[0] + 1 : rules[-1]]
    last = lines[-1] if lines else type(exc).__name__
    return f"{last} (log: {handle.paths.stderr})"


def outcome(handle: Any) -> tuple[Any, str | None]:
    """(rank 0's result, None) of a finished job, or (None, why it failed)."""
    why = _error(handle)
    if why is not None:
        return None, why
    results = handle.results()
    return (results[0] if results else None), None


def watch(
    handles: Mapping[Any, Any],
    label: Callable[[Any], str],
    echo: Callable[[str], None],
    on_end: Callable[[Any, Any, str | None], None],
    poll: float,
    again: str = "the same command watches them again",
) -> None:
    """Watch jobs until each has ended: a line whenever one changes state (queued, running,
    finished, failed) with the count of each, and ``on_end(key, result, error)`` as each ends.
    Ctrl-C stops the watching, not the jobs: Interrupted says which go on, and ``again``."""
    left = dict(handles)
    try:
        _watch(left, label, echo, on_end, poll)
    except KeyboardInterrupt:
        ids = ", ".join(str(handle.job_id) for handle in left.values())
        raise Interrupted(f"Ctrl-C: stopped watching; the jobs go on ({ids}); {again}") from None


def _watch(
    left: dict[Any, Any],
    label: Callable[[Any], str],
    echo: Callable[[str], None],
    on_end: Callable[[Any, Any, str | None], None],
    poll: float,
) -> None:
    seen: dict[Any, str] = {}
    refreshed = 0.0
    while left:
        if time.monotonic() - refreshed > poll:  # one sacct for every job of this round
            with contextlib.suppress(Exception):
                for handle in left.values():
                    updater = getattr(getattr(handle, "watcher", None), "update", None)
                    if updater is not None:
                        updater()
                    break
            refreshed = time.monotonic()
        changed = False
        for key, handle in list(left.items()):
            state = job_state(handle)
            if seen.get(key) != state:
                seen[key], changed = state, True
                echo(f"  {label(key)}: {state} (job {handle.job_id})")
            if state in ("finished", "failed"):
                del left[key]
                result, error = outcome(handle)
                on_end(key, result, error)
        if changed:
            counts = {s: sum(1 for v in seen.values() if v == s) for s in ("queued", "running", "finished", "failed")}
            echo("jobs: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
        if left:
            time.sleep(poll)


def poll_seconds(launcher: str) -> float:
    """How often to look at jobs: Slurm's accounting is asked at most this often."""
    return 30.0 if launcher == "slurm" else 0.5


# ---- eblvm run --launcher -------------------------------------------------------------------


def _run_to_resume(path: Path, echo: Callable[[str], None]) -> Path:
    """The run directory ``path`` names (a run's name folder: its latest run, said through
    ``echo``); an error says the run cannot be resumed."""
    import eblvm

    try:
        return eblvm.Run(path, echo=echo).run_dir
    except ConfigError as exc:
        exc.message = f"cannot resume: {exc.message}"
        raise


def submit_run(
    launcher: str, config: SlurmConfig, request: RunRequest, wait: bool, echo: Callable[[str], None]
) -> None:
    """``eblvm run --launcher slurm``: check the recipe (or the run to resume) here, submit one
    job that trains it, and say where it lives; with ``wait``, watch it to its end and print its
    final evaluation and ``done:`` as ``eblvm run`` does."""
    import eblvm
    from eblvm.tools import check_unchanged

    overrides = list(request.overrides)
    if request.resume is not None:
        run_dir = _run_to_resume(request.resume, echo)
        had = eblvm.load_recipe(run_dir / RECIPE)
        check_unchanged(had, eblvm.load_recipe(run_dir / RECIPE, overrides), "when resuming")
        data, name, resume = None, run_dir.parent.name, run_dir
    else:
        resolved = eblvm.load_recipe(request.recipe, overrides)
        data = resolved.to_dict()
        if not resolved.logs:
            data["log"] = []
        name, resume = resolved.run.name, None
    out = request.out
    folder = default_folder(config, out)
    ex = executor(launcher, config, folder, name)
    command = request.command or shlex.join(sys.argv)
    job = RunJob(
        launcher, folder, data, request.device, str(out.resolve()), command, str(resume) if resume else None, overrides
    )
    (handle,) = submit(ex, [job])
    where = f"resumes {resume}" if resume else f"trains {name} into a run directory under {out / name}"
    echo(f"submitted {launcher} job {handle.job_id}: {where}")
    echo(f"  its log: {handle.paths.stdout}")
    if not wait:
        return
    ended: dict[str, Any] = {}
    watch(
        {name: handle},
        lambda key: key,
        echo,
        lambda _key, result, error: ended.update(result=result, error=error),
        poll_seconds(launcher),
        f"its log: {handle.paths.stdout}",
    )
    if ended["error"] is not None:
        raise EblvmError(f"job {handle.job_id} failed: {ended['error']}")
    result = ended["result"] or {}
    for key, value in result.get("final", {}).items():
        echo(f"{key.removeprefix('eval/')}: {value:.6g}")
    echo(f"done: {result.get('run_dir')}")


class SlurmLauncher(Launcher):
    """Runs as submitit jobs: ``slurm`` (sbatch on a Slurm cluster) or ``submitit-local``
    (processes on this machine), with ``config``'s resources."""

    runs_as = "a cluster job"

    def __init__(self, kind: str, config: SlurmConfig) -> None:
        self.kind, self.config = kind, config

    def submit(self, request: RunRequest, wait: bool, echo: Callable[[str], None]) -> None:
        require_submitit(self.kind)
        submit_run(self.kind, self.config, request, wait, echo)


def slurm(config: SlurmConfig) -> SlurmLauncher:
    """A Slurm job through submitit (eblvm's 'slurm' extra), requeued with its checkpoint when
    Slurm stops it (docs/cluster.md)."""
    return SlurmLauncher("slurm", config)


def submitit_local(config: SlurmConfig) -> SlurmLauncher:
    """The job a Slurm cluster would run, as processes on this machine (submitit's local executor):
    a cluster set-up tried on a laptop."""
    return SlurmLauncher("submitit-local", config)
