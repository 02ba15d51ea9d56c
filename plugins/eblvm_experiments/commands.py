"""The typer commands of many runs, ``eblvm compare`` and ``eblvm search``; they import the
machinery only when they run. The launcher's options are ``SlurmConfig``'s fields: each command
passes the arguments it does not take itself on (``ctx.args``) to ``launcher_options`` and lists
them in its help.

The commands are declared on ``commands``, a typer app of their own that holds each one's
settings (``context_settings``, ``epilog``); ``register_commands`` hands eblvm their functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from eblvm.plugin import check_device, describe_options, fail, guarded, launcher_options
from eblvm_experiments.launcher import LAUNCHERS, SlurmConfig, SlurmLauncher

LOCAL = LAUNCHERS[0]  # the launcher that trains on this machine
PASSES_ON = {"allow_extra_args": True, "ignore_unknown_options": True}  # the launcher's options reach ctx.args
LAUNCHER = typer.Option(
    LOCAL,
    "--launcher",
    help="local: train on this machine; slurm: as Slurm jobs through submitit (eblvm's 'slurm' extra; "
    "docs/cluster.md); submitit-local: those same jobs as processes on this machine; either takes the "
    "launcher's options listed below",
)
LAUNCHER_OPTIONS = (
    "The launcher's options, with --launcher slurm or submitit-local (each goes over the spec's [launcher] "
    "table):\n\n\b\n" + describe_options(SlurmConfig)
)

commands = typer.Typer()


def cluster_options(launcher: str, args: list[str], command: str) -> dict[str, Any]:
    """The launcher's options given on the command line (``args``: what the command did not take
    itself) as a [launcher] table's keys, those given only. An unknown launcher, and a cluster
    job's option without a cluster launcher (the first in ``SlurmConfig``'s order named), are
    refused in one line; a bad value or an unknown option is a usage error (exit 2)."""
    if launcher not in LAUNCHERS:
        fail(f"--launcher must be {', '.join(LAUNCHERS)}, got '{launcher}'")
    options = launcher_options(SlurmConfig, args, command=command)
    if launcher == LOCAL and options:
        flag = "--" + next(iter(options)).replace("_", "-")
        fail(f"{flag} is an option of {SlurmLauncher.runs_as}: add --launcher slurm")
    return options


@commands.command(context_settings=PASSES_ON, epilog=LAUNCHER_OPTIONS)
def compare(
    ctx: typer.Context,
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
) -> None:
    """Run a set of recipes over seeds (and over a [sweep] grid of recipe values); write a Markdown
    table, a figure and results.json. Running it again resumes: finished runs are not rerun,
    killed ones continue. With --launcher slurm the runs are one Slurm job array (resources from
    the spec's [launcher] table and these options), watched until they end.

    A spec's keys, each with its default in docs/compare.md: [compare] name, seeds, seed_offset,
    metrics, curve, curve_range, image (default: the recipes' first density-plot or sample-grid
    evaluator), n_samples, checkpoint, eval_mode, overrides, table_steps; [[method]] name,
    recipe, overrides, sweep; [[eval]] and [[final_eval]] evaluators; [sweep] a grid of recipe
    keys, [launcher] Slurm resources (the launcher's options below go over them). Every path in
    a spec is relative to the spec file.
    """
    check_device(device)
    options = cluster_options(launcher, ctx.args, "eblvm compare")
    if launcher != LOCAL and jobs != 1:
        fail("--jobs is for --launcher local; a cluster runs the array's jobs at once (--array-parallelism)")

    def go() -> None:
        from eblvm_experiments.compare import compare as run_compare

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


@commands.command(context_settings=PASSES_ON, epilog=LAUNCHER_OPTIONS)
def search(
    ctx: typer.Context,
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
) -> None:
    """Search a recipe's keys with Optuna (eblvm's 'search' extra): each trial a run directory, hopeless
    ones pruned from their evaluations, the study in a database that later commands and other
    workers continue; then a table of the trials and Optuna's plots."""
    check_device(device)
    options = cluster_options(launcher, ctx.args, "eblvm search")

    def go() -> None:
        from eblvm_experiments.search import search as run_search

        folder = run_search(
            spec,
            n_trials,
            workers,
            steps,
            out,
            storage,
            device,
            override,
            echo=typer.echo,
            launcher=launcher,
            slurm=options,
        )
        typer.echo(f"done: {folder}")

    guarded(go)
