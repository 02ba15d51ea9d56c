"""The ``eblvm`` command line (typer). User errors print one line and exit with code 2."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Optional

import typer

from eblvm_core.errors import ConfigError, EblvmError, TrainingDiverged

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Learn energy-based latent variable models from TOML recipes.")


def fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def guarded(fn: Callable[[], None]) -> None:
    """Run ``fn``; user-facing errors become one line on stderr and a non-zero exit."""
    try:
        fn()
    except TrainingDiverged as exc:
        fail(str(exc), code=3)
    except EblvmError as exc:
        fail(str(exc))


@app.command()
def run(
    recipe: Optional[Path] = typer.Argument(None, help="recipe file (omit with --resume)"),
    override: list[str] = typer.Option([], "-o", "--override", help="section.key=value; repeatable"),
    device: Optional[str] = typer.Option(None, help="cpu, cuda or auto (default: the recipe's)"),
    out: Path = typer.Option(Path("runs"), help="folder that holds run directories"),
    resume: Optional[Path] = typer.Option(None, help="continue the run in this run directory"),
) -> None:
    """Train a model as a recipe says; print the final evaluation."""
    if device not in (None, "cpu", "cuda", "auto"):
        fail(f"--device must be cpu, cuda or auto, got '{device}'")
    if (recipe is None) == (resume is None):
        fail("give a recipe file or --resume RUN_DIR (one of them)")

    def go() -> None:
        from eblvm_core.trainer import run as train

        run_dir, results = train(recipe, override, device, out, resume, echo=typer.echo)
        for key, value in results.items():
            typer.echo(f"{key.removeprefix('eval/')}: {value:.6g}")
        typer.echo(f"done: {run_dir}")

    guarded(go)


@app.command()
def validate(
    recipes: list[Path] = typer.Argument(..., help="recipe files"),
    override: list[str] = typer.Option([], "-o", "--override", help="section.key=value; repeatable"),
) -> None:
    """Check recipes against the registered components without running anything."""
    from eblvm_core.recipe import load_recipe

    bad = 0
    for path in recipes:
        try:
            load_recipe(path, override)
            typer.echo(f"ok: {path}")
        except ConfigError as exc:
            typer.echo(f"error: {exc}", err=True)
            bad += 1
    if bad:
        raise typer.Exit(2)


@app.command()
def plugins() -> None:
    """List plugins, what each registers, and each component's config fields."""
    from eblvm_core.config import describe
    from eblvm_core.plugins import load

    loaded = load()
    for info in loaded.plugins:
        typer.echo(f"{info.name}  ({info.module})")
        for kind, names in info.components.items():
            for name in names:
                entry = loaded[kind].get(name)
                typer.echo(f"  {kind[:-1]} {name}: {entry.doc}")
                for field, tp, default, help_ in describe(entry.config):
                    typer.echo(f"      {field}: {tp} = {default}  {help_}".rstrip())
        for cmd, _fn, plugin in loaded.commands:
            if plugin == info.name:
                typer.echo(f"  command {cmd}")
    for name, why in loaded.failed.items():
        typer.echo(f"{name}  FAILED: {why}")


def main() -> None:
    from eblvm_core.plugins import load

    for name, fn, _plugin in load().commands:
        app.command(name)(fn)
    app()


if __name__ == "__main__":
    sys.exit(main())
