"""Short training runs through the real trainer, for tests: ``run_short`` and what it returns."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import attrs


@attrs.frozen
class RunResult:
    """What a short run left: its directory, final evaluation, metrics.jsonl rows and resolved recipe."""

    run_dir: Path
    results: dict[str, float]
    metrics: list[dict[str, Any]]
    recipe: dict[str, Any]

    def series(self, key: str) -> list[float]:
        """Values of ``key`` (e.g. "train/loss") over the logged rows that have it."""
        return [row[key] for row in self.metrics if key in row]


def read_recipe(recipe: str | Path | dict) -> dict[str, Any]:
    """A recipe given as TOML text, a path or a dict, as a dict of its own (a copy)."""
    if isinstance(recipe, dict):
        return json.loads(json.dumps(recipe))  # a deep copy
    if isinstance(recipe, str) and ("\n" in recipe or "[" in recipe):
        return tomllib.loads(recipe)
    with open(recipe, "rb") as fh:
        return tomllib.load(fh)


def run_short(
    recipe: str | Path | dict, out: str | Path, steps: int = 5, loggers: bool = False, **overrides: Any
) -> RunResult:
    """Train ``steps`` steps of a recipe (TOML text, a path or a dict) with the real trainer in ``out``.

    ``overrides`` set recipe values: ``estimator__inner_steps=1`` or ``**{"optim.model.lr": 1e-2}``.
    The seed defaults to 0; loggers ([[log]], TensorBoard by default) are dropped unless
    ``loggers``. Raises what the trainer raises (ConfigError, TrainingDiverged).
    """
    import tomli_w

    from eblvm_core.launching import RunRequest
    from eblvm_core.recipe import apply_override
    from eblvm_core.session import run

    raw = read_recipe(recipe)
    raw.setdefault("run", {}).setdefault("seed", 0)
    raw["run"]["steps"] = steps
    for key, value in overrides.items():
        apply_override(raw, f"{key.replace('__', '.')}={tomli_w.dumps({'v': value})[4:].strip()}")
    if not loggers:
        raw["log"] = []
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "short_run.toml"
    path.write_text(tomli_w.dumps(raw))
    run_dir, results = run(RunRequest(path, out=out / "runs"), echo=lambda _line: None)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return RunResult(run_dir, results, rows, tomllib.loads((run_dir / "recipe.toml").read_text()))
