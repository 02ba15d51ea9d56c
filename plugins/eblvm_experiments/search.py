"""``eblvm search SPEC.toml``: a hyperparameter search with Optuna (eblvm's ``search`` extra).

Each trial is an ordinary run directory (``<results>/runs/trial-NNNN/<timestamp>``) whose
recipe.toml holds the trial's values, trained by ``eblvm.train``; its console goes to
``logs/trial-NNNN.log``. Every evaluation during training reports the metric to the trial, and
when the pruner says so the run ends there, cleanly: that evaluation is its last, last.pt holds
its step, and run.json says "pruned" (``eblvm.train``'s ``after_evaluation``; Optuna stays out
of the engine).

The study lives in an Optuna storage: a SQLite file beside the runs by default, or any SQLAlchemy
URL (``[search] storage``, ``--storage``). So ``eblvm search`` started again continues it: the
trials that ended are kept, a trial a stop signal interrupted (or whose worker vanished, by
Optuna's heartbeat) is queued again and resumes its run directory, and new trials run until the
study holds ``n_trials`` that completed, were pruned or diverged. Several workers share it:
``--workers N`` processes here, or N Slurm jobs with ``--launcher slurm``; each asks the study for
its next trial, so no trial runs twice (near the end several workers may each start one more,
as Optuna's ``MaxTrialsCallback`` allows). At the end ``table.md`` (every trial, best first),
``results.json`` and Optuna's plots (``importance.png``, ``history.png``, ``intermediate.png``)
are written beside the study.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import as_completed
from pathlib import Path
from typing import Any

from eblvm.plugin import ConfigError, EblvmError, Interrupted, TrainingDiverged
from eblvm.tools import output_file, output_folder, worker_pool
from eblvm_experiments.launcher import Job
from eblvm_experiments.search_spec import PRUNERS, SAMPLERS, SearchSpec, check_optuna_options, load_search_spec

HEARTBEAT_SECONDS = 60  # a running trial's worker says it is alive this often
GRACE_SECONDS = 300  # a trial not heard of for this long is failed and queued again (its worker vanished)
RUN_NAME = "trial-{:04d}"
RUN_NAME_ATTR = "run_name"  # a trial's user attribute: the name of its runs (a retried trial keeps its first's)


def require_optuna() -> Any:
    """The optuna module, or a one-line error naming the extra that brings it."""
    try:
        import optuna
    except ImportError:
        from eblvm.tools import install_hint

        raise EblvmError(f"eblvm search needs Optuna, eblvm's 'search' extra: {install_hint('search')}") from None
    return optuna


@contextlib.contextmanager
def quiet_optuna() -> Iterator[Any]:
    """Optuna without its log lines (eblvm prints its own) and experimental-feature warnings."""
    optuna = require_optuna()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        warnings.filterwarnings("ignore", category=FutureWarning, module="optuna")
        yield optuna


def storage_url(spec: SearchSpec, out: Path, storage: str | None) -> str:
    """The study's storage: ``storage`` (the command line's), [search] storage, else a SQLite file
    ``study.db`` in ``out``."""
    return storage or spec.search.storage or f"sqlite:///{(out / 'study.db').resolve()}"


def sqlite_file(url: str) -> Path | None:
    """The file of a SQLite storage URL (``sqlite:///relative.db``, ``sqlite:////absolute.db``);
    None for a database server or an in-memory database."""
    if not url.startswith("sqlite:///"):
        return None
    name = url.removeprefix("sqlite:///").partition("?")[0]
    return Path(name) if name and name != ":memory:" else None


def shown(url: str) -> str:
    """A storage URL as printed and written down: its password hidden."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a URL SQLAlchemy reads: said as given, without credentials
        return url.split("@")[-1] if "@" in url else url


@contextlib.contextmanager
def _made_alone(url: str) -> Iterator[None]:
    """For a SQLite file, hold a lock beside it (``<file>.lock``, fcntl) while the storage's tables
    and the study are made; a database server serialises that itself."""
    path = sqlite_file(url)
    if path is None:
        yield
        return
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on POSIX
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _retry_class(optuna: Any) -> Any:
    """Optuna's callback class that queues a failed trial again (renamed in Optuna 4.9)."""
    return (
        getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None) or optuna.storages.RetryFailedTrialCallback
    )


def _retry_callback(optuna: Any) -> Any:
    """Queue a failed trial again with its values, user attributes (its run's name) and the values
    it reported (the pruner sees the whole run once it resumes)."""
    return _retry_class(optuna)(max_retry=None, inherit_intermediate_values=True)


def open_study(spec: SearchSpec, url: str, seed_for: int = 0) -> Any:
    """The spec's study in ``url`` (made on first use; a study of another spec in it is refused)
    with the spec's sampler (seeded from [search] seed, ``seed_for`` and the trials so far, so
    that workers and later commands draw other values) and pruner; heartbeats let a worker that
    vanishes have its trial failed and queued again."""
    import numpy as np

    with quiet_optuna() as optuna:
        engine = {"connect_args": {"timeout": 120}} if url.startswith("sqlite") else None
        retry = _retry_callback(optuna)
        callback = (
            "heartbeat_stale_trial_callback"
            if hasattr(optuna.storages, "RetryHeartbeatStaleTrialCallback")
            else "failed_trial_callback"
        )
        with _made_alone(url):  # two workers starting at once must not both create the tables
            for attempt in range(3):
                try:
                    storage = optuna.storages.RDBStorage(
                        url,
                        engine_kwargs=engine,
                        heartbeat_interval=HEARTBEAT_SECONDS,
                        grace_period=GRACE_SECONDS,
                        **{callback: retry},
                    )
                    break
                except Exception as exc:  # noqa: BLE001 - SQLAlchemy's many errors: a bad URL, a missing driver
                    if type(exc).__name__ in ("IntegrityError", "OperationalError") and attempt < 2:
                        time.sleep(1.0)  # another worker was making the tables on a database server
                        continue
                    first = (str(exc).strip().splitlines() or [""])[0]
                    raise ConfigError(
                        "search", "storage", f"{shown(url)}: {type(exc).__name__}: {first}", file=str(spec.path)
                    ) from None
            search = spec.search
            probe = optuna.create_study(
                study_name=spec.name, storage=storage, direction=search.direction, load_if_exists=True
            )
        recorded = probe.user_attrs.get("eblvm")
        wanted = spec.fingerprint()
        if recorded is None:
            probe.set_user_attr("eblvm", wanted)
        elif recorded != wanted:
            differs = [key for key in wanted if recorded.get(key) != wanted[key]]
            raise ConfigError(
                "search",
                "name",
                f"the study '{spec.name}' in {shown(url)} was made by another search (it differs in: {', '.join(differs)}): "
                "continue it with the same spec and options, or name a new study",
                file=str(spec.path),
            )
        seed = None
        if search.seed is not None:  # each worker its own stream, and each later command
            trials = probe.get_trials(deepcopy=False)
            state = [search.seed, seed_for, len(trials)]
            if any(t.state == optuna.trial.TrialState.RUNNING for t in trials):
                state.append(os.getpid())  # another worker is at work: draw otherwise than it
            seed = int(np.random.SeedSequence(state).generate_state(1)[0] % 2**31)
        sampler = getattr(optuna.samplers, SAMPLERS[search.sampler])(seed=seed, **search.sampler_options)
        pruner = getattr(optuna.pruners, PRUNERS[search.pruner])(**search.pruner_options)
        return optuna.load_study(study_name=spec.name, storage=storage, sampler=sampler, pruner=pruner)


def settled(study: Any) -> int:
    """Trials with an outcome: completed, pruned, or failed because the run diverged."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL))
    return sum(1 for t in trials if t.state != TrialState.FAIL or "diverged" in t.user_attrs)


def short(metric: str) -> str:
    return metric.removeprefix("eval/")


class Objective:
    """One trial: the recipe with the trial's values (or, for a trial queued again, the run it
    began, resumed), trained by ``eblvm.train`` with the pruner watching its evaluations."""

    def __init__(
        self,
        spec: SearchSpec,
        out: Path,
        device: str | None,
        echo: Callable[[str], None],
        command: str,
        session: dict[str, Any],
    ) -> None:
        self.spec, self.out, self.device, self.echo, self.command = spec, out, device, echo, command
        self.session = session  # what a cluster job adds: stop signals and its launcher record
        self.current: int | None = None  # the trial running now

    def __call__(self, trial: Any) -> float:
        import optuna

        import eblvm

        spec, metric = self.spec, self.spec.search.metric
        self.current = trial.number
        values = {p.key: p.suggest(trial) for p in spec.params}
        retried = trial.user_attrs.get(RUN_NAME_ATTR)  # a trial queued again keeps its first's name
        name = retried or RUN_NAME.format(trial.number)
        trial.set_user_attr(RUN_NAME_ATTR, name)
        resume = None
        if retried:
            with contextlib.suppress(EblvmError):
                resume = eblvm.Run(self.out / "runs" / name, echo=None).run_dir
        shown = "  ".join(f"{key}={_show(value)}" for key, value in values.items())
        self.echo(f"trial {trial.number}: {shown}" + (f"  (resumes {resume})" if resume else ""))
        pruned: list[str] = []

        def report(step: int, scalars: dict[str, float]) -> Any:
            value = scalars.get(metric)
            if value is None or not math.isfinite(value):
                return None
            trial.report(value, step)
            if not trial.should_prune():
                return None
            why = f"pruned at step {step}: {short(metric)} {value:.5g} (trial {trial.number}, {spec.search.pruner} pruner)"
            pruned.append(why)
            return eblvm.Stop("pruned", why)

        log = self.out / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        with open(log, "a") as fh:

            def echo(line: str) -> None:
                fh.write(line + "\n")
                fh.flush()

            try:
                run = eblvm.train(
                    None if resume else spec.trial_recipe(values, name),
                    out=self.out / "runs",
                    resume=resume,
                    device=self.device,
                    echo=echo,
                    after_evaluation=report,
                    command=self.command,
                    **self.session,
                )
            except TrainingDiverged as exc:
                trial.set_user_attr("diverged", str(exc))
                self.echo(f"trial {trial.number}: diverged: {exc}")
                return float("nan")  # a failed trial, counted as settled
        run_dir = run.run_dir
        trial.set_user_attr("run_dir", str(run_dir))
        seconds = time.perf_counter() - start
        if pruned:
            self.echo(f"trial {trial.number}: {pruned[0]} ({seconds:.1f} s)")
            raise optuna.TrialPruned(pruned[0])
        final = run.metrics
        if metric not in final:
            raise ConfigError(
                "search",
                "metric",
                f"trial {trial.number}'s final evaluation has no '{metric}' (it has: {', '.join(final) or 'nothing'})",
                file=str(spec.path),
            )
        self.echo(f"trial {trial.number}: {short(metric)} {final[metric]:.5g} ({seconds:.1f} s)  {run_dir}")
        return float(final[metric])


def _show(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def work(
    spec: SearchSpec,
    out: Path,
    url: str,
    device: str | None,
    worker: int,
    echo: Callable[[str], None],
    command: str,
    session: dict[str, Any] | None = None,
) -> None:
    """One worker: run trials until the study holds ``n_trials`` with an outcome. A trial stopped
    by a signal (or Ctrl-C) is queued again before the worker stops with Interrupted, so the next
    ``eblvm search`` (or the requeued job) resumes its run."""
    import eblvm

    eblvm.load_recipe(spec.recipe)  # the plugins load now, not in the first trial's time
    n = spec.search.n_trials
    study = open_study(spec, url, worker)
    objective = Objective(spec, out, device, echo, command, session or {})

    def enough(study: Any, _trial: Any) -> None:
        if settled(study) >= n:
            study.stop()

    if settled(study) >= n:
        return
    with quiet_optuna() as optuna:
        try:
            study.optimize(objective, callbacks=[enough], gc_after_trial=False)
        except (Interrupted, KeyboardInterrupt) as exc:
            number = objective.current
            trial = next((t for t in study.get_trials(deepcopy=False) if t.number == number), None)
            if trial is not None and trial.state == optuna.trial.TrialState.FAIL:
                _retry_callback(optuna)(study, trial)  # queued again with its values and run name
            again = f"{_again(spec.path)} resumes it"
            if isinstance(exc, KeyboardInterrupt):
                raise Interrupted(
                    f"Ctrl-C: trial {number} stopped at once; it is queued again: {again} from its last checkpoint"
                ) from None
            stopped = str(exc).split("; resume with:")[0]  # the run's own advice names eblvm run
            raise Interrupted(f"{stopped}; trial {number} is queued again: {again}") from None


class SearchJob(Job):
    """A search worker as a cluster job: its trials' sessions stop on the job's signals, the
    interrupted trial is queued again, and submitit requeues the worker, which continues the
    study (the queued trial first)."""

    def __init__(
        self,
        launcher: str,
        folder: Path,
        spec: SearchSpec,
        out: str,
        url: str,
        device: str | None,
        worker: int,
        command: str,
    ) -> None:
        super().__init__(launcher, folder)
        self.spec, self.out, self.url, self.device, self.worker, self.command = spec, out, url, device, worker, command

    def resume_from(self, run_dir: str) -> None:
        """The study, not the job, knows which run to resume."""

    def train(self, stop_signals: tuple[int, ...], launched_by: dict[str, Any]) -> dict[str, Any]:
        session = {"stop_signals": stop_signals, "launched_by": launched_by}
        work(
            self.spec,
            Path(self.out),
            self.url,
            self.device,
            self.worker,
            lambda line: print(line, flush=True),
            self.command,
            session,
        )
        return {"worker": self.worker}


def _again(spec_path: str | Path) -> str:
    return f"eblvm search {spec_path}"


def _work_here(spec: SearchSpec, out: Path, url: str, device: str | None, worker: int, command: str) -> None:
    """A worker process of ``--workers N`` (``worker_pool``): lines straight to the console."""
    work(spec, out, url, device, worker, lambda line: print(line, flush=True), command)


def search(
    spec_path: str | Path,
    n_trials: int | None = None,
    workers: int = 1,
    steps: int | None = None,
    out: str | Path | None = None,
    storage: str | None = None,
    device: str | None = None,
    overrides: Sequence[str] = (),
    echo: Callable[[str], None] = print,
    launcher: str = "local",
    slurm: dict[str, Any] | None = None,
) -> Path:
    """Run the search a spec describes (``search_spec``) until its study holds ``n_trials`` (the
    spec's unless given) trials with an outcome, with ``workers`` workers: processes here, or
    cluster jobs with a ``launcher`` (``slurm``: the command line's resources over the spec's
    [launcher]); then write the table, results.json and the plots into ``out`` (default
    results/<name>) and return it. ``steps`` sets run.steps of every trial (quick looks)."""
    extra = list(overrides) + ([f"run.steps={steps}"] if steps is not None else [])
    spec = load_search_spec(spec_path, extra)
    if n_trials is not None:
        import attrs

        spec = attrs.evolve(spec, search=attrs.evolve(spec.search, n_trials=n_trials))
    check_optuna_options(spec)
    require_optuna()
    cluster = None
    if launcher != "local":
        from eblvm_experiments.launcher import require_submitit, with_options

        cluster = with_options(spec.launcher, slurm or {})
        require_submitit(launcher)
    out = output_folder(out if out is not None else Path("results") / spec.name, "search's results")
    url = storage_url(spec, out, storage)
    database = sqlite_file(url)
    if database is not None:
        output_file(database, "search's study database")
    study = open_study(spec, url)
    n, have = spec.search.n_trials, settled(study)
    where = shown(url) if storage or spec.search.storage else f"{out / 'study.db'}"
    how = f"{workers} worker(s)" + ("" if cluster is None else f" as {launcher} jobs")
    echo(
        f"search {spec.path}: study '{spec.name}' in {where}, {have} of {n} trials done; "
        f"{spec.search.sampler} sampler, {spec.search.pruner} pruner, {how}; results in {out}"
    )
    command = shlex.join(sys.argv)
    if have < n:
        if cluster is not None:
            _run_jobs(launcher, cluster, spec, out, url, device, workers, command, echo)
        elif workers == 1:
            work(spec, out, url, device, 0, echo, command)
        else:
            with worker_pool(workers) as pool:
                futures = [pool.submit(_work_here, spec, out, url, device, w, command) for w in range(workers)]
                errors = []
                try:
                    for future in as_completed(futures):
                        try:
                            future.result()
                        except EblvmError as exc:
                            errors.append(exc)
                except KeyboardInterrupt:  # the workers got the Ctrl-C too: they stop their trials
                    pool.shutdown(wait=True, cancel_futures=True)
                    raise Interrupted(
                        f"Ctrl-C: the workers stopped their trials with a checkpoint; {_again(spec_path)} "
                        "continues the study"
                    ) from None
                if errors:
                    raise errors[0]
    else:
        echo(f"nothing to run: the study holds {have} trials with an outcome (raise --n-trials to search on)")
    table = report(spec, open_study(spec, url), out, url)
    echo(table)
    return out


def _run_jobs(
    launcher: str,
    cluster: Any,
    spec: SearchSpec,
    out: Path,
    url: str,
    device: str | None,
    workers: int,
    command: str,
    echo: Callable[[str], None],
) -> None:
    """The workers as one job array, watched to their end."""
    from eblvm_experiments.launcher import default_folder, executor, poll_seconds, submit, watch

    if url.startswith("sqlite") and workers > 1:
        echo("note: several jobs share a SQLite file; on a network file system prefer a database server (--storage)")
    folder = default_folder(cluster, out).resolve()
    ex = executor(launcher, cluster, folder, spec.name)
    jobs = [SearchJob(launcher, folder, spec, str(out.resolve()), url, device, w, command) for w in range(workers)]
    handles = submit(ex, jobs)
    echo(f"submitted {len(handles)} {launcher} worker job(s); their logs: {folder}")
    failed = []

    def ended(worker: int, _result: Any, error: str | None) -> None:
        if error is not None:
            failed.append(f"worker {worker}: {error}")

    watch(dict(enumerate(handles)), lambda w: f"worker {w}", echo, ended, poll_seconds(launcher))
    if failed:
        echo("failed: " + "; ".join(failed))


# ---- the report -----------------------------------------------------------------------------


def report(spec: SearchSpec, study: Any, out: Path, url: str) -> str:
    """Write table.md (every trial, best first), results.json and Optuna's plots into ``out``;
    returns the table."""
    from optuna.trial import TrialState

    metric, maximize = spec.search.metric, spec.search.direction == "maximize"
    trials = study.get_trials(deepcopy=False)

    def last(t: Any) -> tuple[int | None, float | None]:
        if t.intermediate_values:
            step = max(t.intermediate_values)
            return step, t.intermediate_values[step]
        return None, None

    with quiet_optuna() as optuna:
        retried_as = {n: t.number for t in trials for n in _retry_class(optuna).retry_history(t)}

    def state(t: Any) -> str:
        if t.state == TrialState.FAIL and "diverged" in t.user_attrs:
            return "diverged"
        if t.state == TrialState.FAIL and t.number in retried_as:
            return f"stopped, resumed as trial {retried_as[t.number]}"
        return t.state.name.lower()

    def order(t: Any) -> tuple:
        rank = {"complete": 0, "pruned": 1}.get(state(t), 2)
        value = t.value if t.state == TrialState.COMPLETE else last(t)[1]
        key = -value if maximize and value is not None else value
        return (rank, math.inf if key is None else key, t.number)

    counts: dict[str, int] = {}
    for t in trials:
        counts[state(t)] = counts.get(state(t), 0) + 1
    keys = [p.key for p in spec.params]
    header = ["trial", "state", short(metric), "step", *keys, "time (s)", "run directory"]
    lines = [
        f"Study '{spec.name}' ({shown(url)}): {len(trials)} trials, "
        + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        + f"; {spec.search.direction} {short(metric)}.",
        "",
    ]
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    if complete:
        best = study.best_trial
        values = ", ".join(f"{k}={_show(v)}" for k, v in best.params.items())
        lines += [f"Best: trial {best.number}, {short(metric)} = {best.value:.5g} ({values}).", ""]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    rows = []
    for t in sorted(trials, key=order):
        step, value = last(t)
        if t.state == TrialState.COMPLETE:
            value, step = t.value, None
        seconds = t.duration.total_seconds() if t.duration is not None else None
        run_dir = t.user_attrs.get("run_dir", "")
        cells = [
            str(t.number),
            state(t),
            "" if value is None else f"{value:.5g}",
            "final" if t.state == TrialState.COMPLETE else ("" if step is None else str(step)),
            *(_show(t.params[k]) if k in t.params else "" for k in keys),
            "" if seconds is None else f"{seconds:.1f}",
            os.path.relpath(run_dir, out) if run_dir else "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
        rows.append(
            {
                "number": t.number,
                "state": state(t),
                "value": t.value,
                "params": t.params,
                "intermediate": {str(k): v for k, v in sorted(t.intermediate_values.items())},
                "run_dir": run_dir or None,
                "seconds": seconds,
                "diverged": t.user_attrs.get("diverged"),
            }
        )
    table = "\n".join(lines) + "\n"
    (out / "table.md").write_text(table)
    (out / "results.json").write_text(
        json.dumps({"spec": str(spec.path), "study": spec.name, "storage": shown(url), "trials": rows}, indent=2)
    )
    notes = _plots(study, out, len(complete), short(metric))
    if notes:
        table += "\n" + "\n".join(notes) + "\n"
    return table


def _plots(study: Any, out: Path, complete: int, metric: str) -> list[str]:
    """importance.png, history.png and intermediate.png by Optuna's matplotlib plots, the values
    named ``metric``; a note for each that cannot be drawn yet (importances need two completed
    trials)."""
    import functools

    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    notes = []
    # Optuna's plots set a pyplot style (ggplot) globally; rc_context puts matplotlib's settings back
    # after them, so the evaluators' figures drawn later in this process keep their own look.
    with quiet_optuna() as optuna, matplotlib.rc_context():
        plots = {
            "history.png": functools.partial(
                optuna.visualization.matplotlib.plot_optimization_history, target_name=metric
            ),
            "intermediate.png": optuna.visualization.matplotlib.plot_intermediate_values,
            "importance.png": functools.partial(
                optuna.visualization.matplotlib.plot_param_importances, target_name=metric
            ),
        }
        for name, plot in plots.items():
            if name == "importance.png" and complete < 2:
                notes.append(f"{name}: not drawn: parameter importances need two completed trials ({complete} so far)")
                continue
            try:
                ax = plot(study)
            except Exception as exc:  # noqa: BLE001 - e.g. every trial with the same values
                notes.append(f"{name}: not drawn: {exc}")
                continue
            figure = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
            figure.set_size_inches(8, 5)
            figure.savefig(out / name, dpi=120, bbox_inches="tight")
            plt.close(figure)
    return notes
