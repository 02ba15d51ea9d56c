"""recipe/includes.py: reading recipe files. A missing file or bad TOML is one line; ``include``
merges other recipe files under this one's keys (tables key by key, [[eval]]/[[log]] appended,
``replace`` and ``eval = []`` for the other way). The resolved recipe.toml of a run is the merged
recipe; resume works on it. The bundled files read as themselves."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eblvm_core.errors import ConfigError
from eblvm_core.recipe import load_recipe, parse, read
from tests.support import RECIPES, ROOT, SMALL_RECIPE, one_line_error, strategies


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


# ---- reading a file ------------------------------------------------------------------------------


def test_missing_file_and_bad_toml(cli, write_recipe, tmp_path):
    line = one_line_error(cli(["validate", tmp_path / "nope.toml"]))
    assert "nope.toml" in line and "not found" in line
    bad = write_recipe("[run\nsteps = 1")
    line = one_line_error(cli(["validate", bad]))
    assert str(bad) in line and "invalid TOML" in line


# ---- include -------------------------------------------------------------------------------------


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
    from eblvm_experiments.spec import load_spec

    loaded = load_spec(spec)
    assert [m.name for m in loaded.methods] == ["base", "wide"] and loaded.compare.name == "composed"
    assert loaded.recipes["wide"]["model"] == {"kind": "grbm", "n_hidden": 6}
    assert "include" not in loaded.recipes["wide"]
    result = cli(["validate", spec])
    assert result.exit_code == 0 and f"ok: {spec}" in result.output, result.output


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


def test_validate_show_prints_the_recipe_a_run_would_write(cli, chain, tmp_path):
    """`validate --show` prints the merged recipe with the overrides and every default, the same
    TOML a run writes into its recipe.toml."""
    result = cli(["validate", chain, "--show", "-o", "run.steps=7"])
    assert result.exit_code == 0, result.output
    shown = result.output.split("\n", 1)[1].rsplit("ok: ", 1)[0]
    (tmp_path / "shown.toml").write_text(shown)
    assert load_recipe(tmp_path / "shown.toml").to_dict() == load_recipe(chain, ["run.steps=7"]).to_dict()
    assert "include" not in shown and "steps = 7" in shown


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


# ---- the bundled files ---------------------------------------------------------------------------


def test_the_bundled_recipes_and_specs_compose_to_themselves():
    """No bundled file uses include: reading one composes it to its parsed self."""
    for path in [*RECIPES.glob("*.toml"), *(RECIPES / "compare").glob("*.toml")]:
        assert read(path) == parse(path), path


def test_the_reference_recipe_is_the_main_job():
    """The recipe reference's block (docs/recipes.md) and recipes/grbm_bissm.toml say the same
    thing (comments aside)."""
    import re
    import tomllib

    root = ROOT
    (block,) = re.findall(r"```toml\n(\[run\].*?)```", (root / "docs" / "recipes.md").read_text(), flags=re.S)
    assert tomllib.loads(block) == tomllib.loads((root / "recipes" / "grbm_bissm.toml").read_text())


# ---- merge and parse on their own -----------------------------------------------------------------


def test_merge_puts_the_top_over_the_base_by_kind_of_value():
    from eblvm_core.recipe import merge

    base = {"run": {"steps": 1, "seed": 2}, "eval": [{"kind": "a"}], "sizes": [1, 2], "log": [{"kind": "t"}]}
    top = {"run": {"steps": 3}, "eval": [{"kind": "b"}], "sizes": [3], "log": [], "model": {"kind": "m"}}
    merged = merge(base, top)
    assert merged == {
        "run": {"steps": 3, "seed": 2},  # tables key by key
        "eval": [{"kind": "a"}, {"kind": "b"}],  # a non-empty list of tables appended
        "sizes": [3],  # a plain list replaced
        "log": [],  # an empty list replaced: clears
        "model": {"kind": "m"},
    }
    assert base["run"] == {"steps": 1, "seed": 2}, "merge changes neither input"
    replaced = merge(base, top, frozenset({"eval", "run.steps"}))
    assert replaced["eval"] == [{"kind": "b"}] and replaced["run"] == {"steps": 3, "seed": 2}
    assert merge(base, {"run": {"seed": 5}}, frozenset({"run"}))["run"] == {"seed": 5}


@pytest.mark.parametrize(
    "data, said",
    [
        (b"[run]\xff\n", "not a UTF-8 text file (byte 0xff at offset 5): a recipe is TOML text"),
        (b"[run]\nname = 'a\x00'\n", "holds a NUL byte at offset 15: a recipe is TOML text"),
        (b"[run\n", "invalid TOML: "),
    ],
)
def test_parse_refuses_what_is_no_toml_text_naming_the_file(tmp_path, data, said):
    path = tmp_path / "r.toml"
    path.write_bytes(data)
    with pytest.raises(ConfigError) as refused:
        parse(path)
    assert str(refused.value).startswith(f"{path}: {said}"), str(refused.value)
    with pytest.raises(ConfigError, match="is a directory, not a recipe file"):
        parse(tmp_path)


# ---- properties (hypothesis) ---------------------------------------------------------------------
# Data shaped like recipes: at each path a table, an array of tables or a value, the same in every
# file. (Where the kind changes between files, or a file writes `eval = []`, the grouping of the
# files matters by design: a file's value replaces, or its empty list clears, what its own
# includes gave, and nothing outside them.)

COMPOSE = ("include", "replace")  # the top-level keys that compose files, not data


def toml_file(folder: Path, name: str, data: dict, include: list[str] = ()) -> None:
    import tomli_w

    head = tomli_w.dumps({"include": list(include)}) if include else ""
    (folder / name).write_text(head + tomli_w.dumps(data))


recipe_shapes = strategies.shapes.filter(lambda shape: not set(shape) & set(COMPOSE))


@pytest.mark.slow  # 2-3 s: three recipe-shaped files per example
@pytest.mark.property
@settings(max_examples=50)
@given(data=st.data(), shape=recipe_shapes)
def test_merging_is_associative_and_changes_neither_input(data, shape):
    """merge(merge(a, b), c) == merge(a, merge(b, c)) for any three recipe-shaped files, and neither
    argument is changed."""
    import copy

    from eblvm_core.recipe import merge

    a, b, c = (data.draw(strategies.shaped(shape)) for _ in range(3))
    before = copy.deepcopy((a, b, c))
    assert merge(merge(a, b), c) == merge(a, merge(b, c))
    assert (a, b, c) == before, "merge changed an argument"


@pytest.mark.property
@settings(max_examples=30)
@given(data=st.data(), shape=recipe_shapes)
def test_includes_compose_the_same_however_the_files_are_grouped(data, shape):
    """Three files a, b, c read as one recipe the same whichever way they are grouped: one file
    including [a, b, c]; ab (including a, with b's keys) under c's keys; a and bc (including b,
    with c's keys). Each equals the merge of the three."""
    import tempfile

    from eblvm_core.recipe import merge

    a, b, c = (data.draw(strategies.shaped(shape)) for _ in range(3))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        toml_file(folder, "a.toml", a)
        toml_file(folder, "b.toml", b)
        toml_file(folder, "c.toml", c)
        toml_file(folder, "flat.toml", {}, ["a.toml", "b.toml", "c.toml"])
        toml_file(folder, "ab.toml", b, ["a.toml"])
        toml_file(folder, "left.toml", c, ["ab.toml"])
        toml_file(folder, "bc.toml", c, ["b.toml"])
        toml_file(folder, "right.toml", {}, ["a.toml", "bc.toml"])
        flat, left, right = (read(folder / name) for name in ("flat.toml", "left.toml", "right.toml"))
    assert flat == left == right == merge(merge(a, b), c)


def dotted(node: dict, prefix: str = "") -> list[str]:
    """Every dotted key of a table, tables inside it included."""
    return [
        p
        for k, v in node.items()
        for p in [f"{prefix}{k}", *(dotted(v, f"{prefix}{k}.") if isinstance(v, dict) else [])]
    ]


def without(node: dict, paths: frozenset[str], prefix: str = "") -> dict:
    """``node`` with the dotted keys of ``paths`` taken out."""
    return {
        k: without(v, paths, f"{prefix}{k}.") if isinstance(v, dict) else v
        for k, v in node.items()
        if f"{prefix}{k}" not in paths
    }


@pytest.mark.property
@settings(max_examples=50)
@given(data=st.data(), shape=recipe_shapes)
def test_a_replaced_key_is_the_top_files_value_as_if_the_base_had_none(data, shape):
    """merge(base, top, replace) is merge(base without the replaced keys, top): a replaced key
    takes the including file's value alone, and every other key merges as always."""
    from eblvm_core.recipe import merge

    base, top = data.draw(strategies.shaped(shape)), data.draw(strategies.shaped(shape))
    replace = frozenset(data.draw(st.lists(st.sampled_from(dotted(top)), unique=True))) if top else frozenset()
    assert merge(base, top, replace) == merge(without(base, replace), top)


def reachable_cycle(includes: list[list[int]]) -> bool:
    """Whether a cycle of includes is reachable from file 0."""
    state: dict[int, str] = {}

    def visit(node: int) -> bool:
        state[node] = "open"
        for child in includes[node]:
            if state.get(child) == "open" or (child not in state and visit(child)):
                return True
        state[node] = "done"
        return False

    return visit(0)


@pytest.mark.property
@settings(max_examples=60)
@given(
    st.integers(min_value=1, max_value=5).flatmap(
        lambda n: st.lists(
            st.lists(st.integers(min_value=0, max_value=n - 1), unique=True, max_size=3), min_size=n, max_size=n
        )
    )
)
def test_an_include_cycle_is_refused_and_anything_else_merges_each_file_once(includes):
    """Any include graph of up to five files: read from file 0 it is refused, with the files of the
    loop named in order, exactly when a cycle is reachable; otherwise every reachable file's own
    keys are merged (a file reached twice once) and no other file's."""
    import tempfile

    n = len(includes)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for i, children in enumerate(includes):
            toml_file(folder, f"f{i}.toml", {"files": {f"f{i}": i}}, [f"f{j}.toml" for j in children])
        if reachable_cycle(includes):
            with pytest.raises(ConfigError, match="makes an include cycle") as refused:
                read(folder / "f0.toml")
            loop = refused.value.message.rpartition(": ")[2].split(" -> ")
            assert loop[0] == loop[-1] and len(loop) >= 2
            for outer, inner in zip(loop, loop[1:]):
                assert int(Path(inner).stem[1:]) in includes[int(Path(outer).stem[1:])], loop
            return
        merged = read(folder / "f0.toml")

    reached, todo = set(), [0]
    while todo:
        node = todo.pop()
        if node not in reached:
            reached.add(node)
            todo.extend(includes[node])
    assert merged == {"files": {f"f{i}": i for i in sorted(reached)}} and set(range(n)) >= reached
