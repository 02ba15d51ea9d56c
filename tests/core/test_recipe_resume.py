"""recipe/resume.py: what may change when a run resumes or is evaluated (``RESUMABLE``), what a
checkpoint was trained by (``training_part``), and the refusal of anything else, named by the
override that asked for it."""

from __future__ import annotations

import pytest

from eblvm_core.recipe import RESUMABLE, check_unchanged, differences, training_part
from tests.support import one_line_error

# ---- refusals ------------------------------------------------------------------------------------


def test_a_refused_resume_names_the_override(cli, write_recipe, tmp_path):
    out = tmp_path / "runs"
    assert cli(["run", write_recipe(), "--out", out, "-o", "run.steps=10"]).exit_code == 0
    ((run_dir,),) = [list(p.iterdir()) for p in out.iterdir()]
    line = one_line_error(cli(["run", "--resume", run_dir, "-o", "run.steps=20", "-o", "model.n_hidden=8"]))
    assert line.startswith("error: -o model.n_hidden=8: [model] n_hidden: cannot change when resuming"), line
    line = one_line_error(cli(["run", "--resume", run_dir, "-o", "run.stepz=20"]))
    assert line.startswith("error: -o run.stepz=20: [run] stepz: unknown key"), line


# ---- differences, training_part, check_unchanged ------------------------------------------------


def small(overrides=()):
    import tomllib

    from eblvm_core.recipe import validate_with
    from tests.support import SMALL_RECIPE

    return validate_with(tomllib.loads(SMALL_RECIPE), "r.toml", list(overrides))


def test_differences_walk_both_recipes_with_none_for_what_is_absent():
    a = {"run": {"steps": 1, "seed": 2}, "model": {"kind": "grbm"}, "eval": [{"kind": "x"}]}
    b = {"run": {"steps": 3, "seed": 2}, "eval": [{"kind": "y"}], "sampler": {"kind": "gibbs"}}
    assert differences(a, b) == [
        ("run.steps", 1, 3),
        ("model", {"kind": "grbm"}, None),
        ("eval", [{"kind": "x"}], [{"kind": "y"}]),
        ("sampler", None, {"kind": "gibbs"}),
    ]
    assert differences(a, a) == []


def test_the_training_part_leaves_out_exactly_what_may_change():
    resolved = {
        "run": {"steps": 5, "steps_per_cycle": 2, "seed": 1, "device": "cpu", "patience": 3},
        "data": {"kind": "checkerboard", "root": "/data", "rooted": True},
        "eval": [{"kind": "x"}],
        "evaluation": {"kind": "y"},  # a key that starts like one of RESUMABLE is no such key
        "log": [],
    }
    assert training_part(resolved) == {
        "run": {"steps_per_cycle": 2, "seed": 1},
        "data": {"kind": "checkerboard", "rooted": True},
        "evaluation": {"kind": "y"},
    }
    assert "run.steps" in RESUMABLE and "run.seed" not in RESUMABLE


def test_check_unchanged_allows_what_may_change_and_names_the_first_key_that_may_not():
    from eblvm_core.errors import ConfigError

    before = small()
    check_unchanged(before, small(["run.steps=60", "eval.0.split=train", "~log.0", "run.threads=2"]), "when resuming")
    with pytest.raises(ConfigError) as refused:
        check_unchanged(before, small(["optim.model.lr=0.5", "model.n_hidden=8"]), "when resuming")
    error = refused.value
    assert (error.section, error.key) == ("model", "n_hidden"), "the first difference in the recipe's order"
    assert str(error).startswith(
        "-o model.n_hidden=8: [model] n_hidden: cannot change when resuming (the run has 4, the override gives 8); "
        "what may change: run.steps,"
    )
    sampled = small(["sampler.kind=gibbs"])
    with pytest.raises(ConfigError, match=r"\[sampler\]: cannot change when evaluating \(the run has None"):
        check_unchanged(before, sampled, "when evaluating")
    check_unchanged(before, sampled, "when evaluating", also=("sampler",))


def test_a_section_added_when_resuming_is_refused_naming_the_section_and_the_override():
    from eblvm_core.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        check_unchanged(small(), small(["sampler.kind=gibbs"]), "when resuming")
    assert (refused.value.section, refused.value.key) == ("sampler", None)
    assert str(refused.value).startswith("-o sampler.kind=gibbs: [sampler]: cannot change when resuming")
