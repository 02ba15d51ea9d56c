"""``eblvm recipes`` and ``eblvm runs``: listings read from files, one line per recipe or run."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import typer

from eblvm.plugin import ConfigError, fail
from eblvm.tools import METRICS, PROVENANCE, RECIPE, bundled_recipes, recipe_file


def description(path: Path, width: int = 100) -> str:
    """A recipe's one-line description: its first comment paragraph (before any TOML), without a
    leading "NAME:", cut to ``width`` characters at a word."""
    lines: list[str] = []
    for line in path.read_text(encoding="utf-8-sig").splitlines():
        if not line.startswith("#") or (lines and not line.lstrip("#").strip()):
            break
        lines.append(line.lstrip("#").strip())
    text = " ".join(filter(None, lines)).removeprefix(f"{path.stem}:").strip()
    return text if len(text) <= width else text[: width - 1].rsplit(" ", 1)[0] + "…"


def recipes(
    words: list[str] = typer.Argument(None, metavar="[copy NAME [DEST]]", help="copy NAME [DEST]: an editable copy"),
    force: bool = typer.Option(False, "--force", help="with copy: replace DEST if it exists"),
) -> None:
    """List the bundled recipes and specs (run one by name: `eblvm run grbm_bissm`), or copy one.

    `eblvm recipes copy NAME [DEST]` writes NAME's file to DEST (a file, or a folder to put it in;
    default: NAME's file name here). A copied spec still names its recipes as `eblvm:NAME`, the
    bundled ones, and `include = ["eblvm:NAME"]` builds a recipe of your own on a bundled one.
    """
    words = list(words or [])
    if not words:
        found = bundled_recipes()
        if not found:
            fail("no bundled recipes found: this installation of eblvm lacks its recipe files")
        width = max(map(len, found))
        for name, path in found.items():
            typer.echo(f"{name:<{width}}  {description(path)}".rstrip())
        return
    if words[0] != "copy" or not 2 <= len(words) <= 3:
        fail("usage: eblvm recipes [copy NAME [DEST]]")
    name = words[1]
    try:
        source = recipe_file(f"eblvm:{name.removeprefix('eblvm:')}")
    except ConfigError as exc:  # the name and the closest bundled one
        fail(str(exc))
    dest = Path(words[2]) if len(words) == 3 else Path(source.name)
    if dest.is_dir():
        dest = dest / source.name
    if dest.exists() and not force:
        fail(f"{dest} exists: give another DEST, or --force to replace it")
    try:
        dest.write_text(source.read_text(encoding="utf-8"), encoding="utf-8")
    except OSError as exc:
        fail(f"{dest}: cannot write: {exc.strerror or exc}")
    command = next((c for c in ("compare", "search") if name.removeprefix("eblvm:").startswith(f"{c}/")), "run")
    typer.echo(f"wrote {dest} (from {name}): edit it, then `eblvm {command} {dest}`")


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _last_eval(run_dir: Path) -> tuple[int | None, dict[str, float]]:
    """The last step in metrics.jsonl and the scalars of its last evaluation row."""
    step, evaluation = None, {}
    try:
        lines = (run_dir / METRICS).read_text(encoding="utf-8").splitlines()
    except OSError:
        return None, {}
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:  # a line cut short by a kill
            continue
        step = row.get("step", step)
        scalars = {k: v for k, v in row.items() if k.startswith("eval/")}
        if scalars:
            evaluation = scalars
    return step, evaluation


def _headline(run_dir: Path, evaluation: dict[str, float]) -> str:
    """The recipe's [run] select_metric of the last evaluation, else its first metric: 'key=value'."""
    try:
        recipe = tomllib.loads((run_dir / RECIPE).read_text(encoding="utf-8"))
        chosen = recipe["run"]["select_metric"]
    except (OSError, ValueError, KeyError, TypeError):  # no recipe.toml, or one without the key
        chosen = None
    key = chosen if isinstance(chosen, str) and chosen in evaluation else next(iter(evaluation), None)
    return "" if key is None else f"{key.removeprefix('eval/')}={evaluation[key]:.6g}"


def runs(
    folder: Path = typer.Argument(Path("runs"), help="the folder that holds run directories (--out of run)"),
) -> None:
    """List the runs under a folder, oldest first: name, start, status, steps, the last evaluation's
    headline metric ([run] select_metric, else its first) and device."""
    if not folder.is_dir():
        fail(f"{folder}: no such folder (runs are written under --out, default runs)")
    rows = []
    for provenance in sorted(folder.rglob(PROVENANCE)):
        run_dir = provenance.parent
        data = _read_json(provenance)
        sessions = data.get("sessions") if isinstance(data, dict) else None
        if not isinstance(sessions, list) or not sessions or not all(isinstance(x, dict) for x in sessions):
            sessions = [{}]  # half-written or edited: shown as unreadable
        first, last = sessions[0], sessions[-1]
        step, evaluation = _last_eval(run_dir)
        total = last.get("to_step")
        steps = "" if step is None else f"{step}/{total}" if total else str(step)
        status = last.get("status", "unreadable run.json")
        rows.append(
            (
                str(run_dir.relative_to(folder)),
                first.get("started", ""),
                status,
                steps,
                _headline(run_dir, evaluation),
                last.get("device", ""),
            )
        )
    if not rows:
        typer.echo(f"no runs under {folder}")
        return
    rows.sort(key=lambda row: row[1])
    header = ("RUN", "STARTED", "STATUS", "STEPS", "LAST EVALUATION", "DEVICE")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        typer.echo("  ".join(f"{cell:<{w}}" for cell, w in zip(row, widths)).rstrip())
