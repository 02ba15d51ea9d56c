"""recipe/overrides.py: ``-o`` values. They set typed values, append to [[eval]]/[[log]] at the
list's length and drop (``~eval.N``, ``~section.key``), left to right; an error an `-o` value
caused names that `-o` value in place of the recipe file (`error: -o run.stepz=3: [run] stepz:
unknown key ...`)."""

from __future__ import annotations

import tomllib

import pytest
import tomli_w
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import eblvm
from eblvm_core.errors import ConfigError
from eblvm_core.recipe import apply_override, apply_overrides, load_recipe, read
from tests.support import RECIPES, SMALL_RECIPE, one_line_error, strategies


def commands(path, tmp_path):
    return (["validate", path], ["run", path, "--out", tmp_path / "runs"])


# ---- typed values --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override,fragments",
    [
        ("model.n_hidden=3.5", ["[model] n_hidden", "must be int"]),
        ("modle.n_hidden=3", ["[modle]", "did you mean 'model'"]),
        ("steps=3", ["must look like section.key=value"]),
        ("optim.model.lr=-1", ["[optim.model] lr", "must be > 0"]),
        ("eval.3.kind=x", ["eval.3", "no item 3"]),
    ],
)
def test_override_errors(cli, write_recipe, override, fragments):
    path = write_recipe()
    line = one_line_error(cli(["validate", path, "-o", override]))
    for fragment in fragments:
        assert fragment in line, line


def test_overrides_apply_typed_values(write_recipe):
    from eblvm_core.recipe import load_recipe

    recipe = load_recipe(
        write_recipe(), ["model.n_hidden=6", "optim.model.lr=2e-3", 'run.name="x"', "eval.0.split=train"]
    )
    assert recipe.parts["model"].config.n_hidden == 6
    assert recipe.optim["model"].optimizer.config.lr == 2e-3
    assert recipe.run.name == "x"
    assert recipe.evals[0].config.split == "train"


# ---- -o errors name the -o value -----------------------------------------------------------------


@pytest.mark.parametrize(
    "override, expected",
    [
        ("run.stepz=3", "error: -o run.stepz=3: [run] stepz: unknown key (did you mean 'steps'?); valid keys: "),
        ("model.n_hidden=3.5", "error: -o model.n_hidden=3.5: [model] n_hidden: must be int, got float 3.5"),
        ("optim.model.lr=-1", "error: -o optim.model.lr=-1: [optim.model] lr: must be > 0"),
        ("modle.n_hidden=3", "error: -o modle.n_hidden=3: [modle]: unknown section (did you mean 'model'?)"),
        ("steps=3", "error: -o steps=3: must look like section.key=value (or ~section.key to drop a key)"),
        ("~model.kind", "error: -o ~model.kind: [model] kind: missing; choose one of: "),
        ("eval.0.split=val", "error: -o eval.0.split=val: [eval.0] split: "),  # found when the parts are built
    ],
)
def test_an_override_error_names_the_override(cli, write_recipe, tmp_path, override, expected):
    path = write_recipe()
    for command in commands(path, tmp_path):
        line = one_line_error(cli([*command, "-o", "run.log_every=5", "-o", override]))
        assert line.startswith(expected), line
        assert str(path) not in line, line
    assert not (tmp_path / "runs").exists()


def test_a_bad_key_of_the_file_still_names_the_file(cli, write_recipe, tmp_path):
    path = write_recipe(SMALL_RECIPE.replace("n_hidden = 4", "n_hiden = 4"))
    for command in commands(path, tmp_path):
        line = one_line_error(cli([*command, "-o", "run.steps=3"]))
        assert line.startswith(f"error: {path}: [model] n_hiden: unknown key (did you mean 'n_hidden'?)"), line


def test_an_override_of_a_comparison_names_the_override(cli, tmp_path):
    spec = tmp_path / "spec.toml"
    spec.write_text(f'[[method]]\nname = "DSM"\nrecipe = "{RECIPES / "grbm_dsm.toml"}"\n')
    for command in (["validate", spec], ["compare", spec, "--out", tmp_path / "results"]):
        line = one_line_error(cli([*command, "-o", "run.stepz=3"]))
        assert line.startswith("error: -o run.stepz=3: [run] stepz: unknown key (did you mean 'steps'?)"), line


def test_python_overrides_are_named_as_the_command_line_names_them(tmp_path):
    with pytest.raises(ConfigError, match=r"^-o run\.stepz=3: \[run\] stepz: unknown key"):
        eblvm.train(tomllib.loads(SMALL_RECIPE), overrides={"run.stepz": 3}, out=tmp_path, echo=None)


# ---- overrides that append to and drop from lists ------------------------------------------------


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


# ---- parse_value, set_value, apply_overrides ----------------------------------------------------


@pytest.mark.parametrize(
    "text, value",
    [
        ("1e-3", 1e-3),
        ("30", 30),
        ("true", True),
        ('"x"', "x"),
        ("[64, 64]", [64, 64]),
        ("{ burn_in = 200, final_mean = true }", {"burn_in": 200, "final_mean": True}),
        ("cosine", "cosine"),  # not TOML: a bare string
        ("eval/exact-loglik/test_loglik", "eval/exact-loglik/test_loglik"),
    ],
)
def test_an_override_value_is_toml_or_else_a_bare_string(text, value):
    from eblvm_core.recipe import parse_value

    assert parse_value(text) == value and type(parse_value(text)) is type(value)


def test_set_value_makes_tables_of_known_sections_but_never_a_role_or_an_unknown_section():
    from eblvm_core.recipe import set_value

    raw = tomllib.loads(SMALL_RECIPE)
    set_value(raw, "sampler.burn_in", 5)
    set_value(raw, ["optim", "model", "schedule", "kind"], "cosine")
    assert raw["sampler"] == {"burn_in": 5} and raw["optim"]["model"]["schedule"] == {"kind": "cosine"}
    with pytest.raises(ConfigError, match=r"'optim.posterior.lr': the recipe has no such role"):
        set_value(raw, "optim.posterior.lr", 1.0)
    with pytest.raises(ConfigError, match=r"unknown section \(did you mean 'model'\?\)"):
        set_value(raw, "modle.n_hidden", 3)
    with pytest.raises(ConfigError, match="a value, not a section holding 'x'"):
        set_value(raw, "run.steps.x", 3)


def test_overrides_apply_left_to_right(write_recipe):
    path = write_recipe()
    assert load_recipe(path, ["run.steps=3", "run.steps=4"]).run.steps == 4
    assert load_recipe(path, ["run.steps=3", "~run.steps"]).run.steps == 1000  # the default again
    assert load_recipe(path, ["~run.steps", "run.steps=5"]).run.steps == 5
    raw = read(path)
    apply_override(raw, "eval.1.kind=score-loss")
    apply_override(raw, "~eval.0")
    assert raw["eval"] == [{"kind": "score-loss"}]


# ---- properties (hypothesis) ---------------------------------------------------------------------


def written(value) -> str:
    """A value as an ``-o`` value is written: its TOML text, on one line (inline tables)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {written(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(written(v) for v in value) + "]"
    return tomli_w.dumps({"v": value})[len("v = ") :].strip()


SECTIONS = ["run", "data", "model", "objective", "estimator"]  # SMALL_RECIPE's single tables
paths = st.tuples(st.sampled_from(SECTIONS), strategies.keys)


@pytest.mark.property
@given(value=strategies.values)
def test_any_toml_value_written_after_the_equals_sign_is_that_value(value):
    """``-o key=VALUE``: any TOML value (numbers to the last bit, strings with any character, arrays,
    inline tables) reads back as itself, spaces around it or not."""
    from eblvm_core.recipe import parse_value

    assert strategies.same(parse_value(written(value)), value)
    raw = tomllib.loads(SMALL_RECIPE)
    apply_override(raw, f"model.new = {written(value)} ")
    assert strategies.same(raw["model"]["new"], value)


@pytest.mark.property
@given(word=st.from_regex(r"[A-Za-z_][A-Za-z0-9_.:/-]*", fullmatch=True))
def test_a_word_that_is_no_toml_value_is_taken_as_a_string(word):
    """``-o eval.0.split=train``: a bare word is the string itself, unless it is a TOML value
    (true, false, inf, nan)."""
    from eblvm_core.recipe import parse_value

    assume(word not in ("true", "false", "inf", "nan"))
    assert parse_value(word) == word


@pytest.mark.property
@given(path=paths, value=strategies.values)
def test_an_override_sets_its_key_alone_and_dropping_it_again_gives_the_recipe_back(path, value):
    """``section.key=VALUE`` changes that key and nothing else; ``~section.key`` after it (the key
    new) gives the recipe it started from."""
    import copy

    section, key = path
    raw = tomllib.loads(SMALL_RECIPE)
    before = copy.deepcopy(raw)
    apply_override(raw, f"{section}.{key}={written(value)}")
    assert strategies.same(raw[section][key], value)
    assert {k: v for k, v in raw[section].items() if k != key} == {k: v for k, v in before[section].items() if k != key}
    assert {k: v for k, v in raw.items() if k != section} == {k: v for k, v in before.items() if k != section}
    if key not in before[section]:
        apply_override(raw, f"~{section}.{key}")
        assert raw == before


def disjoint(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """Neither path is the other or holds it."""
    return a[: len(b)] != b and b[: len(a)] != a


@pytest.mark.property
@given(
    first=st.tuples(st.sampled_from(SECTIONS), strategies.keys, strategies.keys),
    second=st.tuples(st.sampled_from(SECTIONS), strategies.keys, strategies.keys),
    depths=st.tuples(st.integers(2, 3), st.integers(2, 3)),
    values=st.tuples(strategies.values, strategies.values),
    drops=st.tuples(st.booleans(), st.booleans()),
)
def test_overrides_of_different_keys_commute(first, second, depths, values, drops):
    """Two ``-o`` values that touch different keys (neither key inside the other: ``model.a`` and
    ``model.b.c``, not ``model.b`` and ``model.b.c``), sets or drops, give the same recipe in
    either order."""
    a, b = first[: depths[0]], second[: depths[1]]
    assume(disjoint(a, b))
    raw = tomllib.loads(SMALL_RECIPE)
    overrides = []
    for path, value, drop in zip((a, b), values, drops):
        if drop:  # drop a key that is there: set it first (before either order)
            apply_override(raw, f"{'.'.join(path)}=1")
        overrides.append(f"~{'.'.join(path)}" if drop else f"{'.'.join(path)}={written(value)}")
    one, other = tomllib.loads(tomli_w.dumps(raw)), tomllib.loads(tomli_w.dumps(raw))
    apply_overrides(one, overrides)
    apply_overrides(other, overrides[::-1])
    assert strategies.same(one, other)


# Override-shaped text: the recipe's section names, its lists' indexes and stray words, dotted,
# with or without a drop's ~ and a value.
override_like = st.builds(
    lambda drop, parts, value: ("~" if drop else "") + ".".join(parts) + value,
    st.booleans(),
    st.lists(
        st.sampled_from(["run", "model", "eval", "log", "optim", "steps", "kind", "0", "1", "5", "x", ""]), max_size=4
    ),
    st.one_of(st.just(""), st.builds(lambda v: "=" + v, st.sampled_from(["1", "x", "[1]", "{a = 1}", "="]))),
)


@pytest.mark.slow  # 1.7-1.9 s in all
@pytest.mark.property
@settings(max_examples=500)  # cheap examples: enough to reach each branch of the grammar
@given(text=st.one_of(strategies.texts, override_like, st.from_regex(r"~?[a-z0-9.~=_ ]{0,20}(=.*)?", fullmatch=True)))
def test_any_override_text_sets_a_value_or_is_a_one_line_error_naming_it(text):
    """Whatever follows ``-o``: it applies, or it is a ConfigError of one line per error, each
    naming the ``-o`` value; never another exception."""
    raw = tomllib.loads(SMALL_RECIPE)
    try:
        apply_overrides(raw, [text])
    except ConfigError as exc:
        assert exc.errors and all(e.file == f"-o {text}" for e in exc.errors)
        assert all("\n" not in e.message for e in exc.errors), [e.message for e in exc.errors]
