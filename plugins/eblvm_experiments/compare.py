"""``eblvm compare SPEC.toml``: run several recipes over several seeds (optionally in parallel
processes) and summarise them in a results folder:

- ``table.md``: mean ± std over seeds of each chosen metric per method (and the wall time), or
  per grid point of each method when the spec has a [sweep];
- ``figure.png``: one image per method side by side (an evaluator's figure, e.g. the density
  plot, or model samples) above the learning curves of one metric from metrics.jsonl;
- ``results.json``: every run's directory, seed, time and tabulated metrics;
- ``recipes/`` (each method's recipe as run), ``runs/`` (run directories), ``logs/`` (console
  output of each run), ``done/`` (each finished run's tabulated result).

Running the same command again resumes: a run whose ``done/`` record matches its recipe is not
rerun, a run directory left by a killed comparison continues from its last checkpoint (also
when only ``run.steps`` grew, so a 20,000-step comparison extends to 100,000), anything else
starts afresh.

Runs train through ``eblvm.train`` and are evaluated again through ``eblvm.load``. A spec's
format: ``eblvm_experiments.spec``.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import json
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Container, Mapping, Sequence
from concurrent.futures import as_completed
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eblvm.plugin import ConfigError, EblvmError, TrainingDiverged
from eblvm.tools import RECIPE, output_folder, worker_pool
from eblvm_experiments.launcher import Job
from eblvm_experiments.spec import Spec, load_spec, select, slug

FINISHED = ("finished", "stopped early")  # how a session ends that wrote the run's final evaluation

# ---- running --------------------------------------------------------------------------------


def run_one(task: dict[str, Any], **session: Any) -> dict[str, Any]:
    """Train one (row, seed) and gather what the summary needs; runs in a worker process
    when --jobs > 1, in a cluster job with a launcher (``session``: what it passes on to
    ``eblvm.train``). Returns {method (the row's name), seed, run_dir, seconds (with the earlier
    sessions' of a resumed run), final, image}, and for a grid point {grid: {method, point}}."""
    import eblvm

    eblvm.load_recipe(task["recipe"], task["overrides"])  # the plugins load now, before the clock starts
    if task["threads"]:
        torch.set_num_threads(task["threads"])
    log_path = Path(task["log"])
    log_path.parent.mkdir(parents=True, exist_ok=True)
    earlier = seconds_so_far(task["resume"]) if task["resume"] else 0.0  # a resumed run's earlier sessions
    start = time.perf_counter()
    with open(log_path, "w") as log:

        def echo(line: str) -> None:
            log.write(line + "\n")
            log.flush()

        where = {"device": task["device"], "echo": echo, "command": task["command"], **session}
        if task["resume"]:
            run = eblvm.train(overrides=task["resume_overrides"], resume=task["resume"], **where)
        else:
            run = eblvm.train(task["recipe"], overrides=task["overrides"], out=task["out"], **where)
    seconds = earlier + time.perf_counter() - start
    run_dir = run.run_dir
    final = _tabulated(run, task)
    image = _image(run_dir, task) if task["image"] and task["first_seed"] else None
    result = {
        "method": task["method"],
        "seed": task["seed"],
        "run_dir": str(run_dir),
        "seconds": seconds,
        "final": final,
        "image": image,
    }
    if task.get("grid"):
        result["grid"] = task["grid"]  # a grid point's method and values, for whoever reads results.json
    return result


def seconds_so_far(run_dir: str | Path) -> float:
    """The wall time of a run's sessions that recorded their end in run.json, summed: what a
    resumed run took before; a session killed without an end counts 0."""
    try:
        sessions = json.loads((Path(run_dir) / "run.json").read_text())["sessions"]
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0
    parse = datetime.datetime.fromisoformat
    ended = [s for s in sessions if isinstance(s, dict) and s.get("started") and s.get("ended")]
    return float(sum((parse(s["ended"]) - parse(s["started"])).total_seconds() for s in ended))


def _tabulated(run: Any, task: dict[str, Any]) -> dict[str, float]:
    """The metrics of the tabulated checkpoint of ``run`` (an ``eblvm.Run``): its final
    evaluation (read back from metrics.jsonl for a resumed run that had finished already), or a
    new one, of best.pt or by the [[final_eval]] evaluators, recorded in the run as ``eblvm eval``
    records one (metrics.jsonl, its [[log]] loggers)."""
    import eblvm

    if task["checkpoint"] == "last" and not task["final_evals"]:
        return run.metrics
    loaded = eblvm.load(
        run.run_dir, task["checkpoint"], device=task["device"], evaluators=task["final_evals"] or None, echo=None
    )
    return loaded.evaluate(record=True, echo=None).scalars


def _image(run_dir: Path, task: dict[str, Any]) -> str | None:
    """Render the method's image from the tabulated checkpoint into images/<method>.png."""
    from torchvision.utils import save_image

    import eblvm

    if task["image"] == "samples":
        loaded = eblvm.load(run_dir, task["checkpoint"], device=task["device"], echo=None)
        image = loaded.sample_image(task["n_samples"])
    else:
        loaded = eblvm.load(run_dir, task["checkpoint"], device=task["device"], evaluators=[task["image"]], echo=None)
        images = loaded.evaluate(echo=None).images
        if not images:
            return None
        image = next(iter(images.values()))
    path = Path(task["images_dir"]) / f"{slug(task['method'])}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_image(image.float().cpu(), path)
    return str(path)


# ---- resuming a comparison ------------------------------------------------------------------


def fingerprint(task: dict[str, Any], resolved: dict[str, Any]) -> str:
    """What decides a run's tabulated result: its resolved recipe (``Recipe.to_dict()``) and how
    it is tabulated."""
    what = {key: task[key] for key in ("checkpoint", "final_evals", "image", "n_samples")}
    return json.dumps({"recipe": resolved, **what}, sort_keys=True, default=str)


PATHS = ("run_dir", "image")  # result entries stored relative to the results folder


def done_record(task: dict[str, Any], out: Path) -> dict[str, Any] | None:
    """The result recorded in done/ by an earlier comparison for this very task, else None."""
    path = Path(task["done"])
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
        result = {k: str(out / v) if k in PATHS and v is not None else v for k, v in saved["result"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if saved.get("fingerprint") != task["fingerprint"] or not Path(result["run_dir"]).is_dir():
        return None
    return result


def write_done_record(task: dict[str, Any], result: dict[str, Any], out: Path) -> None:
    """Record a finished task atomically (a killed comparison never leaves half a record), its
    paths relative to ``out`` so a results folder can be moved or merged with another."""
    relative = {k: os.path.relpath(v, out) if k in PATHS and v is not None else v for k, v in result.items()}
    path = Path(task["done"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"fingerprint": task["fingerprint"], "result": relative}, indent=2))
    os.replace(tmp, path)


WHERE = ("device", "threads")  # [run] keys of where a run trains, not what it trains: a run may move


def continuing(had: dict[str, Any], wanted: dict[str, Any]) -> list[str] | None:
    """The overrides that continue a run whose resolved recipe is ``had`` as one of ``wanted``:
    none when they agree but for where the run trains, ``run.steps=N`` when ``wanted`` only
    trains longer; None when the run cannot become it."""

    def trained(recipe: dict[str, Any]) -> dict[str, Any]:
        return {**recipe, "run": {key: value for key, value in recipe["run"].items() if key not in (*WHERE, "steps")}}

    if trained(had) != trained(wanted):
        return None
    old, new = had["run"]["steps"], wanted["run"]["steps"]
    if old == new:
        return []
    return [f"run.steps={new}"] if new > old else None


def unfinished_run(task: dict[str, Any], wanted: dict[str, Any]) -> tuple[Path, list[str]] | None:
    """(run directory, overrides) to continue: the task's newest run directory with a checkpoint
    whose recipe equals the task's resolved recipe ``wanted`` but for the device and thread count
    (the task's are used) and a smaller run.steps; else None."""
    import eblvm

    runs = Path(task["out"]) / task["name"]
    candidates = sorted(d for d in runs.iterdir() if d.is_dir()) if runs.is_dir() else []
    for run_dir in reversed(candidates):
        if not (run_dir / "checkpoints" / "last.pt").is_file() or not (run_dir / RECIPE).is_file():
            continue
        try:
            had = eblvm.load_recipe(run_dir / RECIPE).to_dict()
        except ConfigError:
            return None
        overrides = continuing(had, wanted)
        return None if overrides is None else (run_dir, overrides)
    return None


def compare(
    spec_path: str | Path,
    seeds: int | None = None,
    jobs: int = 1,
    steps: int | None = None,
    out: str | Path | None = None,
    device: str | None = None,
    overrides: Sequence[str] = (),
    echo: Callable[[str], None] = print,
    only: Sequence[str] = (),
    seed_offset: int | None = None,
    launcher: str = "local",
    slurm: Mapping[str, Any] | None = None,
) -> Path:
    """Run the spec's rows (its methods, or each method's grid points when it sweeps) over seeds
    and write table.md, figure.png and results.json into ``out`` (default results/<name>);
    returns that folder. ``steps`` sets run.steps of every method (quick or smoke runs);
    ``seed_offset`` replaces the spec's first seed (more seeds of a finished comparison);
    ``overrides`` apply to every method after the spec's and the grid's; ``only`` names the rows
    to train, a method's name meaning all its rows (the others are tabulated from earlier runs
    in ``out``: their records in done/, else their finished run directories, without training).
    A run that stops on a NaN or an infinity (TrainingDiverged) is reported, left out of the table
    and not recorded, so a rerun retries it; the others go on, and once everything is tabulated
    the comparison raises TrainingDiverged naming the runs that stopped.

    ``launcher`` "slurm" (or "submitit-local") sends the runs to the cluster as one job array
    with the spec's [launcher] resources, ``slurm`` (the command line's) put over them
    (``launcher.SlurmConfig``), and watches the jobs: a line as each is queued, running, finished
    or failed; each job tabulates its run and writes its done/ record itself. Jobs that are
    still queued or running from an earlier command (jobs.json) are watched, not submitted
    again. Failed jobs are reported after the table (JobsFailed); a rerun retries them."""
    import tomli_w

    import eblvm

    extra = list(overrides) + ([f"run.steps={steps}"] if steps is not None else [])
    spec = load_spec(spec_path, extra)
    cluster = None
    if launcher != "local":
        from eblvm_experiments.launcher import require_submitit, with_options

        cluster = with_options(spec.launcher, slurm or {})
        require_submitit(launcher)
    cfg = spec.compare
    chosen = select(spec, list(only))
    n_seeds = seeds if seeds is not None else cfg.seeds
    out = output_folder(out if out is not None else Path("results") / cfg.name, "comparison's results")
    (out / "recipes").mkdir(exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // jobs) if jobs > 1 else 0
    if cluster is not None:
        threads = cluster.cpus or 0
    command = shlex.join(sys.argv)  # what each run's run.json records as having asked for it
    tasks, resolved = [], []  # resolved: each task's Recipe.to_dict()
    for row in spec.methods:
        recipe_path = out / "recipes" / f"{slug(row.name)}.toml"
        recipe_path.write_text(tomli_w.dumps(spec.recipes[row.name]))
        for i in range(n_seeds):
            seed = (cfg.seed_offset if seed_offset is None else seed_offset) + i
            name = f"{slug(row.name)}-seed{seed}"
            task: dict[str, Any] = {
                "method": row.name,
                "seed": seed,
                "name": name,
                "first_seed": i == 0,
                "device": device,
                "recipe": str(recipe_path),
                "out": str(out / "runs"),
                "threads": threads,
                "overrides": [f"run.seed={seed}", f"run.name={name}"],
                "log": str(out / "logs" / f"{name}.log"),
                "done": str(out / "done" / f"{name}.json"),
                "checkpoint": cfg.checkpoint,
                "final_evals": spec.final_evals,
                "image": cfg.image,
                "n_samples": cfg.n_samples,
                "images_dir": str(out / "images"),
                "resume": None,
                "resume_overrides": [],
                "command": command,
            }
            if row.point:
                task["grid"] = {"method": row.method, "point": row.point}
            resolved.append(eblvm.load_recipe(recipe_path, task["overrides"]).to_dict())
            task["fingerprint"] = fingerprint(task, resolved[-1])
            tasks.append(task)
    if spec.sweeps:
        n_methods = len({row.method for row in spec.methods})
        what = f"{len(spec.methods)} rows ({n_methods} methods, their grid points)"
    else:
        what = f"{len(spec.methods)} methods"
    how = f"{jobs} job(s)" if cluster is None else f"a {launcher} job array"
    echo(f"compare {spec.path}: {what} × {n_seeds} seeds, {how}, results in {out}")
    by_index: dict[int, dict[str, Any]] = {}
    pending = []
    live = _live_jobs(out, tasks) if cluster is not None else {}
    for index, task in enumerate(tasks):
        earlier = done_record(task, out)
        if earlier is not None:
            echo(f"  {task['method']} seed {task['seed']}: done earlier, not rerun  {earlier['run_dir']}")
            by_index[index] = earlier
            continue
        if index in live:
            echo(f"  {task['method']} seed {task['seed']}: job {live[index].job_id} submitted earlier, watched")
            pending.append(index)
            continue
        unfinished = unfinished_run(task, resolved[index])
        # a finished run with nothing left to train is tabulated as it stands
        finished = (
            unfinished is not None and not unfinished[1] and eblvm.Run(unfinished[0], echo=None).status in FINISHED
        )
        if chosen is not None and task["method"] not in chosen and not finished:
            continue
        if unfinished is not None:
            task["resume"], task["resume_overrides"] = str(unfinished[0]), unfinished[1]
            what = "finished earlier, tabulated " if finished else "continuing"
            echo(f"  {task['method']} seed {task['seed']}: {what} {unfinished[0]}")
        pending.append(index)

    stopped: dict[tuple[str, int], str] = {}  # (method, seed) -> why the run stopped

    def done(index: int, outcome: Callable[[], dict[str, Any]]) -> None:
        """Record the run's result, or report it stopped on a NaN (TrainingDiverged) and go on."""
        task = tasks[index]
        try:
            result = outcome()
        except TrainingDiverged as error:
            stopped[task["method"], task["seed"]] = str(error)
            echo(f"  {task['method']} seed {task['seed']}: stopped, left out of the table: {error}")
            return
        write_done_record(task, result, out)
        echo(f"  {result['method']} seed {result['seed']}: {result['seconds']:.1f} s  {result['run_dir']}")
        by_index[index] = result

    failed: dict[int, str] = {}
    if cluster is not None:
        _run_jobs(launcher, cluster, spec, tasks, pending, live, out, echo, done, failed)
    elif jobs > 1 and len(pending) > 1:
        with worker_pool(jobs) as pool:
            futures = {pool.submit(run_one, tasks[index]): index for index in pending}
            try:
                for future in as_completed(futures):
                    done(futures[future], future.result)
            except BaseException:
                pool.shutdown(cancel_futures=True)
                raise
    else:
        for index in pending:
            done(index, functools.partial(run_one, tasks[index]))
    results = [by_index[index] for index in sorted(by_index)]
    (out / "results.json").write_text(
        json.dumps(
            {"spec": str(spec.path), "seeds": n_seeds, "steps": steps, "overrides": extra, "runs": results}, indent=2
        )
    )
    table = markdown_table(spec, results, stopped={method for method, _ in stopped})
    if stopped:
        table += "\nStopped on a NaN or an infinity, left out of the table:\n\n" + "".join(
            f"- {method} seed {seed}: {why}\n" for (method, seed), why in stopped.items()
        )
    (out / "table.md").write_text(table)
    figure = compose_figure(spec, results)
    if figure is not None:
        from torchvision.utils import save_image

        save_image(figure, out / "figure.png")
    echo(table)
    if failed:
        raise JobsFailed(
            f"{len(failed)} of {len(tasks)} jobs failed and are left out of {out / 'table.md'} "
            "(run the command again to retry them): "
            + "; ".join(f"{tasks[i]['method']} seed {tasks[i]['seed']}: {why}" for i, why in failed.items())
        )
    if stopped:
        raise TrainingDiverged(
            f"{len(stopped)} of {len(tasks)} runs stopped on a NaN or an infinity and are left out of "
            f"{out / 'table.md'}: " + ", ".join(f"{method} seed {seed}" for method, seed in stopped)
        )
    return out


# ---- cluster jobs ----------------------------------------------------------------------------

JOBS = "jobs.json"  # a results folder's record of the jobs it submitted, by run name


class TaskJob(Job):
    """One run of a comparison (``compare.run_one``'s task) in a job array: trains or resumes it,
    tabulates it, writes its done/ record itself (a comparison no longer watching picks it up
    later) and returns the result, or {"diverged": why} when it stopped on a NaN."""

    def __init__(self, launcher: str, folder: Path, task: dict[str, Any], out: str) -> None:
        super().__init__(launcher, folder)
        self.task, self.out = dict(task), out

    def resume_from(self, run_dir: str) -> None:
        super().resume_from(run_dir)
        self.task["resume"], self.task["resume_overrides"] = run_dir, []

    def train(self, stop_signals: tuple[int, ...], launched_by: dict[str, Any]) -> dict[str, Any]:
        if self.resume is not None:
            self.resume_from(self.resume)
        try:
            result = run_one(self.task, stop_signals=stop_signals, launched_by=launched_by)
        except TrainingDiverged as exc:
            return {"diverged": str(exc)}
        write_done_record(self.task, result, Path(self.out))
        return result


class JobsFailed(EblvmError):
    """Cluster jobs of a comparison failed (their runs are left out of the table)."""

    exit_code = 1


def _digest(fingerprint: str) -> str:
    return hashlib.sha256(fingerprint.encode()).hexdigest()[:16]


def _job_records(out: Path) -> dict[str, Any]:
    try:
        records = json.loads((out / JOBS).read_text())
    except (OSError, ValueError):
        return {}
    return records if isinstance(records, dict) else {}


def _live_jobs(out: Path, tasks: list[dict[str, Any]]) -> dict[int, Any]:
    """Jobs of an earlier command still queued or running, by task index."""
    from eblvm_experiments.launcher import job_state, reattach

    records, live = _job_records(out), {}
    for index, task in enumerate(tasks):
        record = records.get(task["name"])
        handle = reattach(record) if isinstance(record, dict) else None
        if (
            handle is not None
            and isinstance(record, dict)
            and record.get("fingerprint") == _digest(task["fingerprint"])
        ):
            with contextlib.suppress(Exception):  # a job the cluster forgot is submitted again
                if job_state(handle) in ("queued", "running"):
                    live[index] = handle
    return live


def _run_jobs(
    launcher: str,
    cluster: Any,
    spec: Spec,
    tasks: list[dict[str, Any]],
    pending: list[int],
    live: dict[int, Any],
    out: Path,
    echo: Callable[[str], None],
    done: Callable[[int, Callable[[], dict[str, Any]]], None],
    failed: dict[int, str],
) -> None:
    """Submit the pending runs that no earlier job is training as one job array, record the jobs
    in jobs.json, and watch every job to its end (``launcher.watch``)."""
    from eblvm_experiments.launcher import default_folder, executor, job_record, poll_seconds, submit, watch

    handles = {index: live[index] for index in pending if index in live}
    fresh = [index for index in pending if index not in live]
    if fresh:
        folder = default_folder(cluster, out).resolve()
        ex = executor(launcher, cluster, folder, spec.compare.name)
        submitted = submit(ex, [TaskJob(launcher, folder, tasks[i], str(out)) for i in fresh])
        records = _job_records(out)
        for index, handle in zip(fresh, submitted):
            handles[index] = handle
            record = job_record(launcher, handle, folder, cluster.tasks_per_node * cluster.nodes)
            records[tasks[index]["name"]] = {**record, "fingerprint": _digest(tasks[index]["fingerprint"])}
        (out / JOBS).write_text(json.dumps(records, indent=1))
        ids = submitted[0].job_id if len(submitted) == 1 else f"{submitted[0].job_id} to {submitted[-1].job_id}"
        echo(f"submitted {len(fresh)} {launcher} job(s), {ids}; their logs: {folder}")

    def ended(index: int, result: Any, error: str | None) -> None:
        if error is not None:
            failed[index] = error
            echo(f"  {tasks[index]['method']} seed {tasks[index]['seed']}: job failed: {error}")
            return

        def outcome() -> dict[str, Any]:
            if isinstance(result, dict) and "diverged" in result:
                raise TrainingDiverged(result["diverged"])
            return result

        done(index, outcome)

    watch(
        handles,
        lambda index: f"{tasks[index]['method']} seed {tasks[index]['seed']}",
        echo,
        ended,
        poll_seconds(launcher),
    )


# ---- summaries ------------------------------------------------------------------------------


def mean_std(values: list[float]) -> str:
    """'mean ± std' (sample std over seeds), or just the mean for one value."""
    if not values:
        return "n/a"
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.4g}"
    return f"{mean:.4g} ± {statistics.stdev(values):.2g}"


def markdown_table(spec: Spec, results: list[dict[str, Any]], stopped: Container[str] = frozenset()) -> str:
    """One row per method (or grid point): each metric's mean ± std over seeds, the curve metric at each of
    ``table_steps`` (from metrics.jsonl), and the mean wall time per run; a row without results reads
    "stopped" if its name is in ``stopped`` (every seed stopped on a NaN), else "not run"."""
    metrics, cfg = spec.compare.metrics, spec.compare
    at_steps = [f"{cfg.curve.removeprefix('eval/')} at step {step:,}" for step in cfg.table_steps]
    header = ["method", *(m.removeprefix("eval/") for m in metrics), *at_steps, "seeds", "time per run (s)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in spec.methods:
        runs = [r for r in results if r["method"] == method.name]
        if not runs:
            why = "stopped" if method.name in stopped else "not run"
            lines.append("| " + " | ".join([method.name, *[why] * (len(header) - 3), "0", "n/a"]) + " |")
            continue
        cells = [method.name]
        for metric in metrics:
            cells.append(mean_std([r["final"][metric] for r in runs if metric in r["final"]]))
        curves = [dict(learning_curve(r["run_dir"], cfg.curve)) for r in runs] if cfg.table_steps else []
        for step in cfg.table_steps:
            cells.append(mean_std([curve[step] for curve in curves if step in curve]))
        cells += [str(len(runs)), f"{statistics.fmean(r['seconds'] for r in runs):.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def learning_curve(run_dir: str | Path, metric: str) -> list[tuple[int, float]]:
    """(step, value) of ``metric`` in a run's metrics.jsonl (training-time records only)."""
    points = []
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if metric in record and "checkpoint" not in record and math.isfinite(record[metric]):
            points.append((int(record["step"]), float(record[metric])))
    return points


def mean_curve(curves: list[list[tuple[int, float]]]) -> list[tuple[int, float]]:
    """Average over seeds at the steps every seed reports."""
    common = set.intersection(*(set(s for s, _ in c) for c in curves)) if curves else set()
    return [(step, statistics.fmean(dict(c)[step] for c in curves)) for step in sorted(common)]


def compose_figure(spec: Spec, results: list[dict[str, Any]]) -> Tensor | None:
    """The methods' images in titled rows at their own resolution above the learning curves of
    ``spec.compare.curve`` on the axis ``curve_axis`` fits (``figures.comparison``): (3, H, W) in
    [0, 1], or None when there is neither."""
    import numpy as np
    from PIL import Image

    from eblvm.tools import render
    from eblvm_experiments.figures import comparison

    panels = []
    for method in spec.methods:
        path = next((r["image"] for r in results if r["method"] == method.name and r["image"]), None)
        if path is not None:
            panels.append((method.name, np.asarray(Image.open(path).convert("RGB"))))
    curves = {}
    if spec.compare.curve:
        for method in spec.methods:
            per_seed = [learning_curve(r["run_dir"], spec.compare.curve) for r in results if r["method"] == method.name]
            curve = mean_curve([c for c in per_seed if c])
            if curve:
                curves[method.name] = curve
    if not panels and not curves:
        return None
    axis = curve_axis(curves, spec.compare.curve_range) if curves else None
    return render(comparison(panels, curves, spec.compare.curve, axis))


def curve_axis(curves: dict[str, list[tuple[int, float]]], value_range: list[float] | None) -> tuple[float, float]:
    """The value axis (low, high) of the curve plot: the data's range, narrowed to ``value_range``
    (curve_range) only as far as it keeps the later half of every curve in view, so early
    excursions are clipped but a short run is never flattened onto the clip value. When most
    curves end inside the range, one whose whole later half lies outside it (a method that
    diverged) is clipped too instead of squashing the others."""
    values = [v for c in curves.values() for _, v in c]
    lo, hi = min(values), max(values)
    if value_range:
        halves = [[v for _, v in c[len(c) // 2 :]] for c in curves.values()]
        inside = [h for h in halves if any(value_range[0] <= v <= value_range[1] for v in h)]
        late = [v for h in (inside if 2 * len(inside) > len(halves) else halves) for v in h]
        lo = min(max(lo, value_range[0]), min(late))
        hi = max(min(hi, value_range[1]), max(late))
    pad = 0.05 * (hi - lo) if hi > lo else 0.5 * max(abs(lo), 1e-3)
    return lo - pad, hi + pad
