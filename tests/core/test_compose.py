"""Recipes compose: ``include`` merges other recipe files under this one's keys (tables key by key,
[[eval]]/[[log]] appended, ``replace`` and ``eval = []`` for the other way), and ``-o`` overrides
append (``eval.N.key=value`` at the list's length) and drop (``~eval.N``, ``~section.key``)
entries. The resolved recipe.toml of a run is the merged recipe; resume works on it."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from eblvm_core.errors import ConfigError
from eblvm_core.recipe import apply_override, load_recipe, parse, read
from tests.support import RECIPES, SMALL_RECIPE, one_line_error


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def chain(tmp_path: Path) -> Path:
    """top.toml includes sub/mid.toml (a string, relative to top), which includes ../base.toml
    (the small recipe): each level sets one key of a table and adds one [[eval]]."""
    write(tmp_path, "base.toml", SMALL_RECIPE)
    write(
        tmp_path,
        "sub/mid.toml",
        """
        include = ["../base.toml"]

        [model]
        n_hidden = 3

        [[eval]]
        kind = "density-plot"
        grid = 20
        """,
    )
    return write(
        tmp_path,
        "top.toml",
        """
        include = "sub/mid.toml"

        [run]
        steps = 6
        checkpoint_every = 3

        [[eval]]
        kind = "score-loss"
        """,
    )


def test_later_keys_win_tables_merge_key_by_key_and_eval_lists_are_appended(chain):
    raw = read(chain)
    base = parse(chain.parent / "base.toml")
    assert "include" not in raw and "replace" not in raw
    assert raw["run"] == {**base["run"], "steps": 6, "checkpoint_every": 3}  # the including file's keys win
    assert raw["model"] == {"kind": "grbm", "n_hidden": 3}  # the middle file's key over the base's
    assert raw["data"] == base["data"] and raw["optim"] == base["optim"]  # untouched tables as included
    assert raw["eval"] == [{"kind": "exact-loglik"}, {"kind": "density-plot", "grid": 20}, {"kind": "score-loss"}]
    recipe = load_recipe(chain)
    assert [s.kind for s in recipe.evals] == ["exact-loglik", "density-plot", "score-loss"]
    assert recipe.run.steps == 6 and recipe.parts["model"].config.n_hidden == 3


def test_later_includes_win_over_earlier_ones_and_the_file_over_both(tmp_path):
    write(tmp_path, "base.toml", SMALL_RECIPE)
    write(tmp_path, "fast.toml", "[optim.model]\nlr = 0.05\nmax_grad_norm = 1.0\n[run]\nsteps = 3\n")
    write(tmp_path, "faster.toml", "[optim.model]\nlr = 0.1\n")
    top = write(tmp_path, "top.toml", 'include = ["base.toml", "fast.toml", "faster.toml"]\n[run]\nsteps = 4\n')
    raw = read(top)
    assert raw["optim"]["model"] == {"kind": "adam", "lr": 0.1, "max_grad_norm": 1.0}
    assert raw["run"]["steps"] == 4


def test_replace_and_an_empty_list_give_the_other_rule(tmp_path):
    """``replace`` names keys of this file that replace the included value: a list of tables, or a
    table whose kind changes (merged, dsm's sigma would be left under ssm); ``eval = []`` clears."""
    write(tmp_path, "base.toml", SMALL_RECIPE)
    merged = write(tmp_path, "merged.toml", 'include = ["base.toml"]\n[objective]\nkind = "ssm"\n')
    with pytest.raises(ConfigError, match=r"\[objective\] sigma: unknown key"):
        load_recipe(merged)
    replaced = write(
        tmp_path,
        "replaced.toml",
        """
        include = ["base.toml"]
        replace = ["objective", "eval"]

        [objective]
        kind = "ssm"

        [[eval]]
        kind = "score-loss"
        """,
    )
    raw = read(replaced)
    assert raw["objective"] == {"kind": "ssm"} and raw["eval"] == [{"kind": "score-loss"}]
    assert raw["model"] == {"kind": "grbm", "n_hidden": 4}  # the rest still merged
    assert load_recipe(replaced).parts["objective"].kind == "ssm"
    cleared = write(tmp_path, "cleared.toml", 'include = ["base.toml"]\neval = []\nlog = []\n')
    recipe = load_recipe(cleared)
    assert recipe.evals == [] and recipe.logs == []


def test_a_comparison_spec_and_its_method_recipes_may_include(cli, tmp_path):
    write(tmp_path, "base.toml", SMALL_RECIPE)
    write(tmp_path, "recipes/wide.toml", 'include = ["../base.toml"]\n[model]\nn_hidden = 6\n')
    write(
        tmp_path,
        "common.toml",
        """
        [compare]
        name = "composed"
        seeds = 1

        [[method]]
        name = "base"
        recipe = "base.toml"
        """,
    )
    spec = write(
        tmp_path,
        "spec.toml",
        """
        include = ["common.toml"]

        [[method]]
        name = "wide"
        recipe = "recipes/wide.toml"
        """,
    )
    from eblvm_core.experiments.spec import load_spec

    loaded = load_spec(spec)
    assert [m.name for m in loaded.methods] == ["base", "wide"] and loaded.compare.name == "composed"
    assert loaded.recipes["wide"]["model"] == {"kind": "grbm", "n_hidden": 6}
    assert "include" not in loaded.recipes["wide"]
    result = cli(["validate", spec])
    assert result.exit_code == 0 and f"ok: {spec}" in result.output, result.output


# ---- overrides that append to and drop from lists ----------------------------------------------


def test_an_override_at_the_length_of_a_list_appends_a_table_and_tilde_drops(write_recipe):
    path = write_recipe()  # one [[eval]]: exact-loglik
    recipe = load_recipe(path, ["eval.1.kind=density-plot", "eval.1.grid=40", "eval.2.kind=score-loss"])
    assert [s.kind for s in recipe.evals] == ["exact-loglik", "density-plot", "score-loss"]
    assert recipe.evals[1].config.grid == 40
    # left to right: the indices are those of the list as it stands
    recipe = load_recipe(path, ["eval.1.kind=density-plot", "eval.2.kind=score-loss", "~eval.0", "~eval.0"])
    assert [s.kind for s in recipe.evals] == ["score-loss"]
    recipe = load_recipe(path, ["~eval.0", "eval.0.kind=score-loss"])  # [[eval]] emptied, then one added
    assert [s.kind for s in recipe.evals] == ["score-loss"]
    # ~section.key drops a key (its default applies again); ~section a whole section
    default_steps = load_recipe(path, ["~run.steps"]).run.steps
    assert default_steps != 30 and default_steps == load_recipe(path, ["~run"]).run.steps
    assert load_recipe(path, ["~eval"]).evals == []


def test_list_overrides_on_a_recipe_without_the_list(write_recipe):
    """No [[eval]]: eval.0 appends to an empty list. No [[log]]: the list is the default logger
    (as recipe.toml shows it), so log.1 appends after it and ~log.0 leaves no logger."""
    path = write_recipe(SMALL_RECIPE.replace('[[eval]]\nkind = "exact-loglik"\n', ""))
    assert load_recipe(path).evals == []
    assert [s.kind for s in load_recipe(path, ["eval.0.kind=score-loss"]).evals] == ["score-loss"]
    raw = read(path)
    apply_override(raw, "log.1.kind=tensorboard")
    assert raw["log"] == [{"kind": "tensorboard"}, {"kind": "tensorboard"}]
    assert [s.kind for s in load_recipe(path).logs] == ["tensorboard"]
    assert load_recipe(path, ["~log.0"]).logs == []


@pytest.mark.parametrize(
    "override, section, fragments",
    [
        ("eval.3.kind=x", "eval.3", ["no item 3 (there are 1; eval.1.<key>=<value> adds one)"]),
        ("~eval.1", "eval", ["no item 1 to drop (there are 1)"]),
        ("~model.n_hiden", "model", ["n_hiden", "nothing to drop", "did you mean 'n_hidden'"]),
        ("~modle", "modle", ["nothing to drop", "did you mean 'model'"]),
        ("~eval.0=1", None, ["a drop looks like ~section.key or ~eval.N, without a value"]),
        ("~", None, ["a drop looks like"]),
        ("eval.kind=x", "eval", ["name an entry by its index, e.g. eval.0.kind"]),
        ("eval.0=x", "eval", ["an entry of [[eval]] is a table"]),
        ("~run.steps.x", "run", ["a value, not a section holding 'x'"]),
        ("~eval.first", "eval", ["no item first to drop"]),
    ],
)
def test_list_override_errors_are_one_line(cli, write_recipe, tmp_path, override, section, fragments):
    path = write_recipe()
    for command in (["validate", path], ["run", path, "--out", tmp_path / "runs"]):
        line = one_line_error(cli([*command, "-o", override]))
        assert line.startswith(f"error: -o {override}: " + (f"[{section}]" if section else "")), line
        for fragment in fragments:
            assert fragment in line, line
    assert not (tmp_path / "runs").exists()


# ---- what a run directory keeps, and resume ------------------------------------------------------


def test_the_run_directory_holds_the_merged_recipe_and_resumes_from_it(cli, chain, tmp_path):
    from eblvm_core.checkpoint import load

    out = tmp_path / "runs"
    result = cli(["run", chain, "--out", out, "-o", "~eval.1", "-o", "eval.2.kind=density-plot", "-o", "eval.2.grid=8"])
    assert result.exit_code == 0, result.output
    (run_dir,) = (out / "small").iterdir()
    saved = parse(run_dir / "recipe.toml")
    assert "include" not in saved and "replace" not in saved
    assert [e["kind"] for e in saved["eval"]] == ["exact-loglik", "score-loss", "density-plot"]
    assert saved["eval"][2]["grid"] == 8 and saved["model"]["n_hidden"] == 3 and saved["run"]["steps"] == 6
    assert saved == load_recipe(chain, ["~eval.1", "eval.2.kind=density-plot", "eval.2.grid=8"]).to_dict()
    # resume extends the run and may append or drop evaluators (RESUMABLE), not change the model
    result = cli(["run", "--resume", run_dir, "-o", "run.steps=9", "-o", "~eval.2", "-o", "eval.2.kind=score-loss"])
    assert result.exit_code == 0, result.output
    assert load(run_dir / "checkpoints" / "last.pt")["step"] == 9
    line = one_line_error(cli(["run", "--resume", run_dir, "-o", "run.steps=12", "-o", "~model.n_hidden"]))
    assert "[model] n_hidden" in line and "cannot change when resuming" in line


# ---- refusals ------------------------------------------------------------------------------------


def test_an_include_cycle_is_one_line_naming_its_files(cli, tmp_path):
    a = write(tmp_path, "a.toml", 'include = ["sub/b.toml"]\n' + SMALL_RECIPE)
    b = write(tmp_path, "sub/b.toml", 'include = ["c.toml"]\n')
    write(tmp_path, "sub/c.toml", 'include = ["../a.toml"]\n')
    for command in (["validate", a], ["run", a, "--out", tmp_path / "runs"]):
        line = one_line_error(cli(command))
        c = b.parent / "c.toml"
        assert line == f"error: {c}: include: '../a.toml' makes an include cycle: {a} -> {b} -> {c} -> {a}", line
    assert not (tmp_path / "runs").exists()
    itself = write(tmp_path, "self.toml", 'include = ["self.toml"]\n' + SMALL_RECIPE)
    line = one_line_error(cli(["validate", itself]))
    assert line.endswith(f"makes an include cycle: {itself} -> {itself}"), line


def test_a_diamond_is_no_cycle_and_merges_its_base_once(tmp_path):
    """Two files may include one base (no cycle): it is merged once, where first included, so
    right's copy of the base neither undoes left's n_hidden nor repeats the base's [[eval]]."""
    write(tmp_path, "base.toml", SMALL_RECIPE)
    write(tmp_path, "left.toml", 'include = ["base.toml"]\n[model]\nn_hidden = 2\n')
    write(tmp_path, "right.toml", 'include = ["base.toml"]\n[run]\nsteps = 2\n')
    top = write(tmp_path, "top.toml", 'include = ["left.toml", "right.toml"]\n')
    recipe = load_recipe(top)
    assert recipe.run.steps == 2 and recipe.parts["model"].config.n_hidden == 2
    assert [s.kind for s in recipe.evals] == ["exact-loglik"]


@pytest.mark.parametrize(
    "text, fragments",
    [
        ('include = ["nope.toml"]\n', ["include: 'nope.toml': no such file", "nope.toml)"]),
        ('include = ["sub"]\n', ["include: 'sub': is a directory, not a recipe file"]),
        ("include = 3\n", ["include: must be a file name or a list of them", "got 3"]),
        ("include = []\n", ["include: must be a file name or a list of them"]),
        ('include = ["base.toml"]\nreplace = ["evl"]\neval = []\n', ["replace: 'evl' is not a key of this file"]),
        ('replace = ["eval"]\neval = []\n', ["replace: names keys that replace the included files' values"]),
        ('include = ["bad.toml"]\n', ["bad.toml: invalid TOML"]),
    ],
)
def test_a_wrong_include_is_one_line_naming_the_including_file_and_key(cli, tmp_path, text, fragments):
    write(tmp_path, "base.toml", SMALL_RECIPE)
    write(tmp_path, "bad.toml", "[run\nsteps = 1\n")
    (tmp_path / "sub").mkdir()
    path = write(tmp_path, "r.toml", text)
    for command in (["validate", path], ["run", path, "--out", tmp_path / "runs"]):
        line = one_line_error(cli(command))
        if "bad.toml" not in text:
            assert line.startswith(f"error: {path}: "), line
        for fragment in fragments:
            assert fragment in line, line
    assert not (tmp_path / "runs").exists()


def test_the_bundled_recipes_and_specs_compose_to_themselves():
    """No bundled file uses include: reading one composes it to its parsed self."""
    for path in [*RECIPES.glob("*.toml"), *(RECIPES / "compare").glob("*.toml")]:
        assert read(path) == parse(path), path


def test_recipe_data_with_include_is_refused_by_name():
    """Includes are relative to a file: data given as a dict cannot hold one."""
    from eblvm_core.recipe import validate

    with pytest.raises(ConfigError, match=r"<data>: include: is resolved when a recipe file is read"):
        validate({"include": ["base.toml"]}, "<data>")


def test_validate_show_prints_the_recipe_a_run_would_write(cli, chain, tmp_path):
    """`validate --show` prints the merged recipe with the overrides and every default, the same
    TOML a run writes into its recipe.toml."""
    result = cli(["validate", chain, "--show", "-o", "run.steps=7"])
    assert result.exit_code == 0, result.output
    shown = result.output.split("\n", 1)[1].rsplit("ok: ", 1)[0]
    (tmp_path / "shown.toml").write_text(shown)
    assert load_recipe(tmp_path / "shown.toml").to_dict() == load_recipe(chain, ["run.steps=7"]).to_dict()
    assert "include" not in shown and "steps = 7" in shown
