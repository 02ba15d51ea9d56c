"""Sweeps: a comparison spec's [sweep] is a grid over recipe keys; each [[method]] gives one table
row per grid point, run over the seeds with compare's resume, --only and --jobs."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from eblvm_core import checkpoint as ckpt
from eblvm_core.errors import ConfigError
from eblvm_core.recipe import load_recipe, parse
from tests.support import RECIPES, SMALL_RECIPE, one_line_error, session_run

LOGLIK = "eval/exact-loglik/test_loglik"
ROWS = ["DSM lr=0.01 H=2", "DSM lr=0.01 H=3", "DSM lr=0.03 H=2", "DSM lr=0.03 H=3"]

GRID_SPEC = f"""
[compare]
name = "grid"
seeds = 1
metrics = ["{LOGLIK}"]
curve = "{LOGLIK}"
overrides = ["run.eval_every=6", "run.checkpoint_every=6", "run.log_every=6"]

[sweep]
"optim.model.lr" = [1e-2, 3e-2]
"model.n_hidden" = {{ values = [2, 3], label = "H" }}

[[method]]
name = "DSM"
recipe = "r.toml"
"""


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def grid_spec(tmp_path: Path) -> Path:
    write(tmp_path, "r.toml", "log = []\n" + SMALL_RECIPE)
    return write(tmp_path, "spec.toml", GRID_SPEC)


def table_rows(out: Path) -> dict[str, str]:
    lines = (out / "table.md").read_text().splitlines()[2:]
    return {line.split(" | ")[0].removeprefix("| "): line for line in lines}


@pytest.mark.slow
def test_a_2x2_grid_runs_in_parallel_tabulates_four_rows_and_reruns_nothing(cli, grid_spec, tmp_path, monkeypatch):
    out = tmp_path / "results"
    args = ["compare", grid_spec, "--jobs", "2", "--steps", "12", "--out", out, "--device", "cpu"]
    result = cli(args)
    assert result.exit_code == 0, result.output
    assert "4 rows (1 methods, their grid points) × 1 seeds" in result.output
    rows = table_rows(out)
    assert list(rows) == ROWS  # the first key varies slowest
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [r["method"] for r in runs] == ROWS
    for r, (lr, hidden) in zip(runs, [(1e-2, 2), (1e-2, 3), (3e-2, 2), (3e-2, 3)]):
        assert r["grid"] == {"method": "DSM", "point": {"optim.model.lr": lr, "model.n_hidden": hidden}}
        run_dir = Path(r["run_dir"])
        assert run_dir.parent.name == r["method"].replace(" ", "_").replace("=", "_") + "-seed0"
        recipe = load_recipe(run_dir / "recipe.toml")  # each point trained its own recipe
        assert recipe.optim["model"].optimizer.config.lr == lr and recipe.parts["model"].config.n_hidden == hidden
        state = ckpt.load(run_dir / "checkpoints" / "last.pt")
        assert state["step"] == 12 and state["networks"]["model"]["W"].shape == (2, hidden)
        assert f"{r['final'][LOGLIK]:.4g}" in rows[r["method"]]
    assert sorted(p.name for p in (out / "recipes").iterdir()) == [
        f"{n.replace(' ', '_').replace('=', '_')}.toml" for n in ROWS
    ]
    assert (out / "figure.png").is_file()

    from eblvm_experiments import compare as comparison

    trained: list[str] = []
    real_run_one = comparison.run_one
    monkeypatch.setattr(comparison, "run_one", lambda task: trained.append(task["method"]) or real_run_one(task))
    table = (out / "table.md").read_text()
    comparison.compare(grid_spec, steps=12, out=out, device="cpu", echo=lambda _: None)
    assert trained == [] and (out / "table.md").read_text() == table


@pytest.mark.slow
def test_a_killed_sweep_resumes_and_only_takes_a_row_or_a_method(grid_spec, tmp_path, monkeypatch):
    """Killed while training the third point at step 6 of 12: --only naming that row continues it
    alone (to the parameters of an uninterrupted run), --only naming the method trains what is
    left of its rows, and a plain rerun trains nothing."""
    from eblvm_experiments import compare as comparison

    out = tmp_path / "results"
    real_run_one, trained = comparison.run_one, []

    def killed_at_the_third_point(task):
        trained.append(task["method"])
        if task["method"] == ROWS[2]:
            session_run(task["recipe"], [*task["overrides"], "run.steps=6"], "cpu", task["out"], echo=lambda _: None)
            raise KeyboardInterrupt
        return real_run_one(task)

    monkeypatch.setattr(comparison, "run_one", killed_at_the_third_point)
    with pytest.raises(KeyboardInterrupt):
        comparison.compare(grid_spec, steps=12, out=out, device="cpu", echo=lambda _: None)
    assert trained == ROWS[:3] and not (out / "results.json").exists()

    def counted(task):
        trained.append(task["method"])
        return real_run_one(task)

    monkeypatch.setattr(comparison, "run_one", counted)
    trained.clear()
    lines: list[str] = []
    comparison.compare(grid_spec, steps=12, out=out, device="cpu", echo=lines.append, only=[ROWS[2]])
    assert trained == [ROWS[2]]
    assert any(f"{ROWS[2]} seed 0: continuing" in line for line in lines), lines
    rows = table_rows(out)
    assert "not run" in rows[ROWS[3]] and all("not run" not in rows[name] for name in ROWS[:3])
    (killed,) = (out / "runs" / "DSM_lr_0.03_H_2-seed0").iterdir()
    assert ckpt.load(killed / "checkpoints" / "last.pt")["step"] == 12
    assert len(json.loads((killed / "run.json").read_text())["sessions"]) == 2
    straight, _ = session_run(
        out / "recipes" / "DSM_lr_0.03_H_2.toml",
        ["run.seed=0", "run.name=straight"],
        "cpu",
        tmp_path / "x",
        echo=lambda _: None,
    )
    want = ckpt.load(straight / "checkpoints" / "last.pt")["networks"]["model"]
    got = ckpt.load(killed / "checkpoints" / "last.pt")["networks"]["model"]
    assert all(torch.equal(got[k], v) for k, v in want.items())

    trained.clear()
    comparison.compare(grid_spec, steps=12, out=out, device="cpu", echo=lambda _: None, only=["DSM"])
    assert trained == [ROWS[3]]
    assert all("not run" not in line for line in table_rows(out).values())
    trained.clear()
    comparison.compare(grid_spec, steps=12, out=out, device="cpu", echo=lambda _: None)
    assert trained == []

    with pytest.raises(ConfigError, match=r"--only 'DSM lr=0.02' is neither a method nor a row .*'DSM lr=0.01 H=2'"):
        comparison.compare(grid_spec, steps=12, out=out, device="cpu", echo=lambda _: None, only=["DSM lr=0.02"])


def test_validate_checks_every_grid_point(cli, grid_spec):
    result = cli(["validate", grid_spec])
    assert result.exit_code == 0 and f"ok: {grid_spec}" in result.output, result.output
    bad = grid_spec.parent / "bad.toml"
    bad.write_text(grid_spec.read_text().replace("values = [2, 3]", "values = [2, 0]"))
    line = one_line_error(cli(["validate", bad]))
    recipe = grid_spec.parent / "r.toml"
    assert line.startswith(f"error: {recipe}: [model] n_hidden: must be > 0"), line
    assert f"(grid point 'DSM lr=0.01 H=0' of {bad})" in line
    # a key the recipe cannot take fails at the first point, naming the sweep key
    bad.write_text(grid_spec.read_text().replace('"optim.model.lr"', '"optim.modle.lr"'))
    line = one_line_error(cli(["validate", bad]))
    assert "[optim.modle]" in line and "[sweep] key 'optim.modle.lr'" in line and "did you mean 'model'" in line
    # a point that validates but cannot be built is refused by the dry run too
    bad.write_text(grid_spec.read_text().replace("values = [2, 3]", "values = [2, 40]"))
    line = one_line_error(cli(["validate", bad]))
    assert "[eval.0]" in line


@pytest.mark.parametrize(
    "sweep, key, fragment",
    [
        ('"optim.model.lr" = 0.01', "optim.model.lr", "must be a non-empty list of values"),
        ('"optim.model.lr" = []', "optim.model.lr", "must be a non-empty list of values"),
        ("steps = [1, 2]", "steps", "must name a recipe key as section.key"),
        ('"run.seed" = [1, 2]', "run.seed", "cannot be swept: seeds come from [compare] seeds"),
        ('"optim.model.lr" = [0.01, 0.01]', "optim.model.lr", "values must differ"),
        (
            '"optim.model.lr" = [0.01]\n"optim.posterior.lr" = [0.1]',
            "optim.posterior.lr",
            "its label 'lr' is also optim.model.lr's",
        ),
        ('"model.n_hidden" = { values = [2], lable = "H" }', "model.n_hidden", "unknown key 'lable'"),
        ('"model.n_hidden" = { values = [2], label = "" }', "model.n_hidden", "label must be a non-empty string"),
        ('"data.kind" = ["a b", "a_b"]', None, "two rows would share the file name of 'DSM kind=a b'"),
    ],
)
def test_a_wrong_sweep_is_one_line_naming_the_spec_and_key(cli, grid_spec, sweep, key, fragment):
    text = GRID_SPEC.split("[sweep]")[0] + "[sweep]\n" + sweep + "\n\n[[method]]" + GRID_SPEC.split("[[method]]")[1]
    grid_spec.write_text(text)
    line = one_line_error(cli(["validate", grid_spec]))
    assert line.startswith(f"error: {grid_spec}: [sweep]" + (f" {key}:" if key else ":")), line
    assert fragment in line, line


def test_grid_rows_labels_and_method_grids(tmp_path):
    """Rows in the order written, the first key slowest; a key written unquoted (nested tables)
    is the same key; a method's own sweep replaces the spec's, and sweep = {} is one plain row."""
    from eblvm_experiments.spec import load_spec, show

    write(tmp_path, "r.toml", SMALL_RECIPE)
    spec = write(
        tmp_path,
        "spec.toml",
        """
        [sweep]
        optim.model.lr = [1e-5, 0.5]
        "estimator.kind" = ["exact-score"]

        [[method]]
        name = "A"
        recipe = "r.toml"

        [[method]]
        name = "B"
        recipe = "r.toml"
        sweep = { "model.learn_sigma" = [true, false] }

        [[method]]
        name = "C"
        recipe = "r.toml"
        sweep = {}
        """,
    )
    loaded = load_spec(spec)
    names = [row.name for row in loaded.methods]
    assert names == [
        "A lr=1e-05 kind=exact-score",
        "A lr=0.5 kind=exact-score",
        "B learn_sigma=true",
        "B learn_sigma=false",
        "C",
    ]
    assert loaded.recipes["A lr=0.5 kind=exact-score"]["optim"]["model"]["lr"] == 0.5
    assert loaded.recipes["B learn_sigma=false"]["model"]["learn_sigma"] is False
    assert loaded.recipes["C"] == parse(tmp_path / "r.toml") | {"eval": [{"kind": "exact-loglik"}]}
    assert loaded.sweeps and loaded.methods[-1].point == {}
    assert [show(v) for v in (3, 0.001, 1e-05, "sgd", False, [64, 64])] == [
        "3",
        "0.001",
        "1e-05",
        "sgd",
        "false",
        "[64, 64]",
    ]


@pytest.mark.parametrize("name", sorted(p.name for p in (RECIPES / "compare").glob("*.toml")))
def test_a_spec_without_a_sweep_has_one_row_per_method(name, monkeypatch):
    from eblvm_experiments.spec import load_spec

    monkeypatch.chdir(RECIPES.parent)
    raw = parse(RECIPES / "compare" / name)
    loaded = load_spec(RECIPES / "compare" / name)
    if "sweep" in raw:
        assert loaded.sweeps and len(loaded.methods) > len(raw["method"])
        return
    assert [row.name for row in loaded.methods] == [m["name"] for m in raw["method"]]
    assert not loaded.sweeps and all(row.point == {} for row in loaded.methods)
