"""A run directory's life and records besides checkpoints: its creation, the lock that keeps a
second process out, ``recipe.toml`` (the resolved recipe), ``metrics.jsonl`` (one JSON row per
logged step or evaluation), ``run.json`` (provenance) and ``run.log`` (the console output).

``run.json`` holds the eblvm, torch and Python versions, every plugin with the distribution and
version that installed it, the device, the number of processes and of CPU threads, the command
line as typed, the working directory, the git commit of eblvm's checkout (when it runs from
one), how a launcher started it (a cluster job's id), and the start, end and status of the
first session and of every resume.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import math
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eblvm_core.errors import ConfigError, EblvmError, FileSystemError
from eblvm_core.recipe import Recipe

if TYPE_CHECKING:
    from eblvm_core.plugins import Loaded, PluginInfo

LOCK = ".lock"
PROVENANCE = "run.json"
LOG = "run.log"
METRICS = "metrics.jsonl"
RECIPE = "recipe.toml"
COMMAND = "EBLVM_COMMAND"  # set by ``eblvm run --nproc-per-node``: the command line as typed, for run.json
RUN_DIR_FILE = "EBLVM_RUN_DIR_FILE"  # set by it too: where rank 0 says which run directory it trains
STORE_FD = "EBLVM_STORE_FD"  # set by it for rank 0: the inherited listening socket rank 0 serves the store on


def new_run_dir(out: str | Path, name: str) -> Path:
    """``<out>/<name>/<YYYYmmdd-HHMMSS>`` (suffixed ``-1``, ``-2``... if taken), created with its
    ``checkpoints/``; safe when several runs start in the same second (mkdir is the claim). A
    FileSystemError when ``out`` refuses."""
    try:
        parent = Path(out) / name
        parent.mkdir(parents=True, exist_ok=True)
        stamp, i = time.strftime("%Y%m%d-%H%M%S"), 0
        while True:
            path = parent / (stamp if i == 0 else f"{stamp}-{i}")
            try:
                path.mkdir()
            except FileExistsError:
                i += 1
                continue
            (path / "checkpoints").mkdir()
            return path
    except OSError as exc:
        raise FileSystemError(
            f"{exc.filename or out}: cannot create the run directory: {exc.strerror or exc}"
        ) from None


STAMP = re.compile(r"(\d{8}-\d{6})(?:-(\d+))?")  # a run directory's name: its start, and a suffix if taken


def _age(path: Path) -> tuple:
    """A sort key: run directories by the start in their names (``new_run_dir``), those named
    otherwise before them."""
    match = STAMP.fullmatch(path.name)
    return (1, match.group(1), int(match.group(2) or 0)) if match else (0, path.name, 0)


def find_run_dir(path: str | Path, doing: str = "") -> tuple[Path, str | None]:
    """(run directory, note) for a path given by the user: a run directory (it holds recipe.toml)
    as it is; a run's name folder (``<out>/<name>``, holding timestamped run directories) gives
    its latest run, and ``note`` says which (else None). A path that does not exist and a folder
    that is not a run are two different ConfigErrors, ``path: <doing: >what``."""
    path = Path(path)
    if (path / RECIPE).is_file():
        return path, None
    prefix = f"{doing}: " if doing else ""
    if not path.exists():
        raise ConfigError("", None, f"{prefix}no such directory", file=str(path))
    if not path.is_dir():
        raise ConfigError("", None, f"{prefix}not a run directory: a file, not a folder", file=str(path))
    runs = sorted((d for d in path.iterdir() if d.is_dir() and (d / RECIPE).is_file()), key=_age)
    if not runs:
        raise ConfigError(
            "",
            None,
            f"{prefix}not a run directory: it has no {RECIPE}, and no run directory inside it has one either",
            file=str(path),
        )
    latest = runs[-1]
    which = f"the latest of its {len(runs)} runs" if len(runs) > 1 else "its one run"
    return latest, f"{path}: a run name's folder; using {which}: {latest}"


def write_recipe(recipe: Recipe, run_dir: Path) -> None:
    """The resolved recipe as run_dir/recipe.toml, atomically."""
    import tomli_w

    tmp = run_dir / f".{RECIPE}.tmp"
    tmp.write_text(tomli_w.dumps(recipe.to_dict()))
    os.replace(tmp, run_dir / RECIPE)


def json_row(step: int, scalars: dict[str, float], **extra: Any) -> str:
    """One metrics.jsonl line: valid JSON, non-finite values written as null and listed with
    their value under ``"nonfinite"`` (e.g. ``{"eval/x": "nan"}``)."""
    row: dict[str, Any] = {"step": step, **extra}
    bad = {}
    for key, value in scalars.items():
        if isinstance(value, float) and not math.isfinite(value):
            row[key], bad[key] = None, repr(value)
        else:
            row[key] = value
    if bad:
        row["nonfinite"] = bad
    return json.dumps(row, allow_nan=False)


def append_metrics(run_dir: Path, step: int, scalars: dict[str, float], **extra: Any) -> None:
    """Append one row to run_dir/metrics.jsonl (``json_row``)."""
    with open(run_dir / METRICS, "a") as fh:
        fh.write(json_row(step, scalars, **extra) + "\n")


def clean_metrics(run_dir: Path, step: int, final_pending: bool) -> None:
    """Drop the training rows of metrics.jsonl written after the checkpoint at ``step`` (they are
    written again as training resumes), and the final evaluation's rows when it runs again;
    rows of ``eblvm eval`` (with a "checkpoint" key) stay."""
    path = run_dir / METRICS
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill
        rerun = row.get("step", 0) > step or (
            final_pending and row.get("step") == step and any(k.startswith("eval/") for k in row)
        )
        if "checkpoint" in row or not rerun:
            kept.append(line)
    tmp = path.with_name(f".{METRICS}.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


class RunLock:
    """An exclusive ``flock`` on ``<run_dir>/.lock``, held while a process trains in the run
    directory; the system releases it when the process ends, even by kill -9. ``release``
    deletes the file while still holding the lock, so a finished run leaves none behind;
    ``acquire`` checks that the file it locked is still the one at the path (a process that
    opened it just before it was deleted locks a new one instead). Without ``fcntl`` (Windows)
    it locks nothing."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK
        self.handle: Any = None

    def acquire(self) -> RunLock:
        """Take the lock or raise EblvmError naming the process that holds it."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not on POSIX
            return self
        while True:
            handle = open(self.path, "a+")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                handle.seek(0)
                holder = handle.read().strip() or "another process"
                handle.close()
                raise EblvmError(
                    f"{self.path.parent}: in use by {holder}; wait for it to end (two processes must not train one run)"
                ) from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(handle.fileno()).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            handle.close()  # deleted by the holder that just released it: lock the new file
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
        self.handle = handle
        return self

    def release(self) -> None:
        """Delete the lock file and drop the lock (closing the file drops the flock)."""
        if self.handle is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()
            self.handle.close()
            self.handle = None


def now() -> str:
    """The local time, ISO 8601 with the UTC offset, to the second."""
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def git_commit() -> dict[str, Any] | None:
    """{"commit", "dirty"} of the git checkout eblvm runs from, or None (installed, no git)."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if commit.returncode != 0:
        return None
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}


# The plugin set plugin_versions last described and what it found: reading the installed
# distributions' metadata takes some 45 ms, once per plugin set (a pool worker trains many runs).
_described: tuple[Loaded, dict[str, dict[str, str | None]]] | None = None


def plugin_versions() -> dict[str, dict[str, str | None]]:
    """Every plugin loaded for this run, by name: its module and the distribution that installed it
    with its version (eblvm's own for the bundled ones; None for a module loaded through
    EBLVM_PLUGIN_MODULES, with the file it came from)."""
    global _described
    from eblvm_core.plugins import load

    loaded = load()
    if _described is None or _described[0] is not loaded:
        _described = (loaded, _versions(loaded.plugins))
    return copy.deepcopy(_described[1])


def _versions(plugins: list[PluginInfo]) -> dict[str, dict[str, str | None]]:
    import importlib.util
    from importlib.metadata import PackageNotFoundError, distribution, entry_points

    from eblvm_core.plugins import BUILTIN, DISTRIBUTION, GROUP

    installed = {ep.name: getattr(ep, "dist", None) for ep in entry_points(group=GROUP)}
    with contextlib.suppress(PackageNotFoundError):
        installed.update({name: distribution(DISTRIBUTION) for name in BUILTIN})  # the core's own
    out: dict[str, dict[str, str | None]] = {}
    for info in plugins:
        dist = installed.get(info.name)
        entry: dict[str, str | None] = {
            "module": info.module,
            "distribution": getattr(dist, "name", None),
            "version": getattr(dist, "version", None),
        }
        if dist is None:  # a module has a file; __main__ (a script, a notebook's kernel) no spec
            module = sys.modules.get(name := info.module.split(":")[0])
            spec = importlib.util.find_spec(name) if module is None or module.__spec__ else None
            entry["file"] = getattr(spec, "origin", None) if spec else getattr(module, "__file__", None)
        out[info.name] = entry
    return out


ENDED = ("finished", "stopped early")  # statuses of a session that ended with the run's final evaluation


def session(device: str, world: int, step: int, threads: int, command: str | None = None) -> dict[str, Any]:
    """Provenance of this process's session on a run, starting at ``step``: the command as typed
    (``eblvm run --nproc-per-node N ...`` for the launch, not what each rank ran; ``command``
    when given, e.g. a Python call), versions, where it ran, and every plugin with its
    distribution and version, and the plugins that failed to load with why."""
    import torch

    from eblvm_core import __version__
    from eblvm_core.plugins import load

    return {
        "started": now(),
        "ended": None,
        "status": "running",
        "from_step": step,
        "command": command or os.environ.get(COMMAND) or shlex.join(sys.argv),
        "cwd": os.getcwd(),
        "host": socket.gethostname(),
        "eblvm": __version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "device": device,
        "processes": world,
        "threads": threads,
        "git": git_commit(),
        "plugins": plugin_versions(),
        "plugins_failed": dict(load().failed),
    }


class Provenance:
    """``run.json``: {"sessions": [...]}, the first the run's start, each later one a resume.
    ``damaged`` is why a run.json that exists could not be read (half-written, edited), else None:
    ``start`` then moves it aside rather than replace what it recorded."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / PROVENANCE
        self.damaged: str | None = None
        try:
            self.data = json.loads(self.path.read_text())
        except FileNotFoundError:
            self.data = {"sessions": []}
        except (OSError, ValueError) as exc:
            self.data, self.damaged = {"sessions": []}, str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if not isinstance(self.data, dict) or not isinstance(self.data.get("sessions"), list):
            self.data, self.damaged = {"sessions": []}, self.damaged or 'it holds no "sessions" list'

    def move_damaged_aside(self) -> Path | None:
        """Rename a damaged run.json to ``run.json.damaged[-N]`` beside it (the first name free);
        returns the new path, or None when it was not damaged."""
        if self.damaged is None or not self.path.exists():
            return None
        target, i = self.path.with_name(f"{PROVENANCE}.damaged"), 0
        while target.exists():
            i += 1
            target = self.path.with_name(f"{PROVENANCE}.damaged-{i}")
        os.replace(self.path, target)
        return target

    @property
    def status(self) -> str | None:
        """How the last session ended (``end``), "running" while it runs, None before any."""
        sessions = self.data["sessions"]
        return sessions[-1].get("status") if sessions else None

    @property
    def finished(self) -> bool:
        """Whether the last session ended with the run's final evaluation (finished, or stopped early)."""
        return self.status in ENDED

    @property
    def seconds(self) -> float:
        """Wall time of the sessions that recorded their end, summed (to the second): the time
        spent on the run so far; a session killed without an end counts 0."""
        parse = datetime.datetime.fromisoformat
        spans = [
            parse(s["ended"]) - parse(s["started"])
            for s in self.data["sessions"]
            if s.get("started") and s.get("ended")
        ]
        return float(sum(span.total_seconds() for span in spans))

    def start(
        self,
        device: str,
        world: int,
        step: int,
        threads: int,
        command: str | None = None,
        launcher: Mapping[str, Any] | None = None,
        training_step: str | None = None,
    ) -> None:
        """Open a session: device, processes and CPU threads per process, from ``step``; ``command``
        says what started it when it was not a command line (``eblvm.train(...)``), ``launcher``
        how it was launched when something launched it (a cluster job: its kind and id),
        ``training_step`` how the step runs ("compiled", "CUDA graph", "eager: <why>")."""
        entry = session(device, world, step, threads, command)
        if training_step is not None:
            entry["training_step"] = training_step
        if launcher is not None:
            entry["launcher"] = dict(launcher)
        self.data["sessions"].append(entry)
        self.write()

    def end(self, status: str, step: int | None) -> None:
        """Record how the current session ended: finished, stopped early ([run] patience),
        pruned (a search's pruner), diverged, interrupted, failed, or killed (by a second Ctrl-C under ``--nproc-per-node``:
        the step is then unknown, None)."""
        if self.data["sessions"]:
            self.data["sessions"][-1].update(ended=now(), status=status, to_step=step)
            with contextlib.suppress(OSError):
                self.write()

    def write(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        os.replace(tmp, self.path)


def announce_run_dir(run_dir: Path) -> None:
    """Rank 0 tells the ``--nproc-per-node`` launcher where the run lives (a no-op otherwise)."""
    target = os.environ.get(RUN_DIR_FILE)
    if target:
        Path(target).write_text(str(run_dir))


class RunLog:
    """Echo a line and append it to ``<run_dir>/run.log``."""

    def __init__(self, run_dir: str | Path, echo: Any):
        self.path, self.echo = Path(run_dir) / LOG, echo

    def __call__(self, line: str) -> None:
        self.echo(line)
        self.write(line)

    def write(self, line: str) -> None:
        """Append to run.log only (what the CLI prints itself, an error line)."""
        with open(self.path, "a") as fh:
            fh.write(line + "\n")


def hyperparameters(recipe: Recipe | dict[str, Any]) -> dict[str, float | int | str | bool]:
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

    resolved = recipe if isinstance(recipe, dict) else recipe.to_dict()
    walk({k: v for k, v in resolved.items() if k not in ("eval", "log")}, "")
    return flat
