"""The typer commands of many runs; they import the machinery only when they run."""

from __future__ import annotations

from pathlib import Path

import typer

from eblvm_core.command import check_device, guarded


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
) -> None:
    """Run a set of recipes over seeds (and over a [sweep] grid of recipe values); write a Markdown
    table, a figure and results.json. Running it again resumes: finished runs are not rerun,
    killed ones continue.

    A spec's keys, each with its default in docs/compare.md: [compare] name, seeds, seed_offset,
    metrics, curve, curve_range, image (default: the recipes' first density-plot or sample-grid
    evaluator), n_samples, checkpoint, eval_mode, overrides, table_steps; [[method]] name,
    recipe, overrides, sweep; [[eval]] and [[final_eval]] evaluators; [sweep] a grid of recipe
    keys. Every path in a spec is relative to the spec file.
    """
    check_device(device)

    def go() -> None:
        from eblvm_core.experiments.compare import compare as run_compare

        folder = run_compare(
            spec, seeds, jobs, steps, out, device, override, echo=typer.echo, only=only, seed_offset=seed_offset
        )
        typer.echo(f"done: {folder}")

    guarded(go)
