"""The typer commands of many runs; they import the machinery only when they run."""

from __future__ import annotations

from pathlib import Path

import typer

from eblvm_core.command import check_device, fail, guarded
from eblvm_core.errors import EblvmError

# The launcher's options, shared by run, compare and search (a spec's [launcher] table holds the
# same keys; these go over it).
LAUNCHER = typer.Option(
    "local",
    "--launcher",
    help="local: train on this machine; slurm: as Slurm jobs through submitit (eblvm's 'slurm' extra; "
    "docs/cluster.md); submitit-local: those same jobs as processes on this machine",
)
PARTITION = typer.Option(None, "--partition", help="slurm: partition")
TIME = typer.Option(
    None, "--time", help="slurm: time limit per job, minutes or HH:MM:SS (a run goes on in a requeued job)"
)
NODES = typer.Option(None, "--nodes", min=1, help="slurm: nodes per job")
GPUS = typer.Option(None, "--gpus", min=0, help="slurm: GPUs per node (one process, rank, each)")
CPUS = typer.Option(None, "--cpus", min=1, help="slurm: CPUs per process")
MEM = typer.Option(None, "--mem", help="slurm: memory per node, e.g. 32G")
ARRAY_PARALLELISM = typer.Option(None, "--array-parallelism", min=1, help="slurm: jobs of an array that run at once")
SBATCH = typer.Option([], "--sbatch", help="slurm: a further sbatch option KEY=VALUE (account=proj); repeatable")


def slurm_options(
    launcher: str,
    partition: str | None = None,
    time: str | None = None,
    nodes: int | None = None,
    gpus: int | None = None,
    cpus: int | None = None,
    mem: str | None = None,
    array_parallelism: int | None = None,
    sbatch: list[str] = (),
    nproc_per_node: int | None = None,
) -> dict:
    """The launcher's command-line options as a [launcher] table's keys (those given); a Slurm
    option without a cluster launcher is refused in one line."""
    from eblvm_core.experiments.launcher import LAUNCHERS, sbatch_options

    if launcher not in LAUNCHERS:
        fail(f"--launcher must be {', '.join(LAUNCHERS)}, got '{launcher}'")
    given = {
        "partition": partition,
        "time": int(time) if time is not None and time.strip().isdigit() else time,
        "nodes": nodes,
        "gpus": gpus,
        "cpus": cpus,
        "mem": mem,
        "array_parallelism": array_parallelism,
        "nproc_per_node": nproc_per_node,
    }
    given = {key: value for key, value in given.items() if value is not None}
    if sbatch:
        try:
            given["sbatch"] = sbatch_options(sbatch)
        except EblvmError as exc:
            fail(str(exc))
    cluster_only = [key for key in given if key != "nproc_per_node"]  # --nproc-per-node serves both
    if launcher == "local" and cluster_only:
        fail(f"--{cluster_only[0].replace('_', '-')} is an option of a cluster job: add --launcher slurm")
    return given


def compare(
    spec: Path = typer.Argument(
        ..., help="comparison spec (TOML with [compare] and [[method]] sections, optionally a [sweep] grid)"
    ),
    seeds: int | None = typer.Option(None, min=1, help="seeds per method or grid point (default: the spec's)"),
    seed_offset: int | None = typer.Option(
        None, min=0, help="first seed (default: the spec's seed_offset); more seeds of a finished comparison"
    ),
    jobs: int = typer.Option(1, min=1, help="runs in parallel processes"),
    steps: int | None = typer.Option(None, min=1, help="override run.steps of every method (quick or smoke runs)"),
    out: Path | None = typer.Option(None, help="results folder (default results/<name>)"),
    override: list[str] = typer.Option([], "-o", "--override", help="section.key=value for every method; repeatable"),
    device: str | None = typer.Option(None, help="auto, cpu, cuda, cuda:N or mps (default: each recipe's)"),
    only: list[str] = typer.Option(
        [],
        "--only",
        help="train only this method (all its grid points) or this grid point, named as its table row "
        "(repeatable); the table still shows every row run so far",
    ),
    launcher: str = LAUNCHER,
    partition: str | None = PARTITION,
    time: str | None = TIME,
    nodes: int | None = NODES,
    gpus: int | None = GPUS,
    cpus: int | None = CPUS,
    mem: str | None = MEM,
    array_parallelism: int | None = ARRAY_PARALLELISM,
    sbatch: list[str] = SBATCH,
) -> None:
    """Run a set of recipes over seeds (and over a [sweep] grid of recipe values); write a Markdown
    table, a figure and results.json. Running it again resumes: finished runs are not rerun,
    killed ones continue. With --launcher slurm the runs are one Slurm job array (resources from
    the spec's [launcher] table and these options), watched until they end.

    A spec's keys, each with its default in docs/compare.md: [compare] name, seeds, seed_offset,
    metrics, curve, curve_range, image (default: the recipes' first density-plot or sample-grid
    evaluator), n_samples, checkpoint, eval_mode, overrides, table_steps; [[method]] name,
    recipe, overrides, sweep; [[eval]] and [[final_eval]] evaluators; [sweep] a grid of recipe
    keys, [launcher] Slurm resources. Every path in a spec is relative to the spec file.
    """
    check_device(device)
    options = slurm_options(launcher, partition, time, nodes, gpus, cpus, mem, array_parallelism, sbatch)
    if launcher != "local" and jobs != 1:
        fail("--jobs is for --launcher local; a cluster runs the array's jobs at once (--array-parallelism)")

    def go() -> None:
        from eblvm_core.experiments.compare import compare as run_compare

        folder = run_compare(
            spec,
            seeds,
            jobs,
            steps,
            out,
            device,
            override,
            echo=typer.echo,
            only=only,
            seed_offset=seed_offset,
            launcher=launcher,
            slurm=options,
        )
        typer.echo(f"done: {folder}")

    guarded(go)


def search(
    spec: Path = typer.Argument(..., help="search spec (TOML with [search] and [params] sections; docs/search.md)"),
    n_trials: int | None = typer.Option(
        None,
        "--n-trials",
        min=1,
        help="the study's size (default: the spec's): trials that completed, were pruned or diverged",
    ),
    workers: int = typer.Option(
        1, min=1, help="workers sharing the study: processes here, or jobs with --launcher slurm"
    ),
    steps: int | None = typer.Option(
        None, min=1, help="override run.steps of every trial (quick looks; a study of its own)"
    ),
    out: Path | None = typer.Option(None, help="results folder (default results/<name>), which holds the SQLite study"),
    storage: str | None = typer.Option(
        None, help="the study's storage, an SQLAlchemy URL (default: the spec's, else sqlite:///OUT/study.db)"
    ),
    override: list[str] = typer.Option([], "-o", "--override", help="section.key=value for every trial; repeatable"),
    device: str | None = typer.Option(None, help="auto, cpu, cuda, cuda:N or mps (default: the recipe's)"),
    launcher: str = LAUNCHER,
    partition: str | None = PARTITION,
    time: str | None = TIME,
    nodes: int | None = NODES,
    gpus: int | None = GPUS,
    cpus: int | None = CPUS,
    mem: str | None = MEM,
    array_parallelism: int | None = ARRAY_PARALLELISM,
    sbatch: list[str] = SBATCH,
) -> None:
    """Search a recipe's keys with Optuna (eblvm's 'search' extra): each trial a run directory, hopeless
    ones pruned from their evaluations, the study in a database that later commands and other
    workers continue; then a table of the trials and Optuna's plots."""
    check_device(device)
    options = slurm_options(launcher, partition, time, nodes, gpus, cpus, mem, array_parallelism, sbatch)

    def go() -> None:
        from eblvm_core.experiments.search import search as run_search

        folder = run_search(
            spec, n_trials, workers, steps, out, storage, device, override, typer.echo, launcher, options
        )
        typer.echo(f"done: {folder}")

    guarded(go)
