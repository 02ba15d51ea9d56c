"""build.py: recipe -> live parts. Every check that can fail before training happens when the parts
are built, so `eblvm validate` (a dry run, ``dry_run``) rejects what `eblvm run` would; a size a
component cannot build is a one-line error naming its section."""

from __future__ import annotations

from types import SimpleNamespace

import attrs
import pytest
import torch

from eblvm_core.errors import ConfigError
from tests.support import BISM, RECIPES, SMALL_RECIPE, one_line_error

# ---- errors found by building --------------------------------------------------------------------


def test_build_time_error_is_one_line(cli, write_recipe, tmp_path):
    """A combination only the component can judge (too many hidden units to enumerate)."""
    path = write_recipe()
    line = one_line_error(cli(["run", path, "--out", tmp_path, "-o", "model.n_hidden=40"]))
    assert str(path) in line and "[eval.0]" in line


# ---- validate is a dry run: what run rejects before its first step, validate rejects -------------

DRY_CASES = [
    (
        "misspelt role",
        BISM,
        "[optim.posterior]",
        "[optim.posteror]",
        ["[optim.posteror]", "unknown role (did you mean 'posterior'?)"],
    ),
    (
        "missing role",
        BISM,
        '[optim.posterior]\nkind = "adam"',
        "",
        ["[optim.posterior] kind", "missing", "trains role 'posterior'"],
    ),
    ("fisher on bernoulli", BISM, 'kind = "kl"', 'kind = "fisher"', ["[divergence] kind", "needs a continuous latent"]),
    (
        "no such split",
        SMALL_RECIPE,
        'kind = "exact-loglik"',
        'kind = "exact-loglik"\nsplit = "val"',
        ["[eval.0] split", "no 'val' split"],
    ),
    (
        "unknown select_metric",
        SMALL_RECIPE,
        "seed = 7",
        'seed = 7\nselect_metric = "eval/exact-loglik/val_loglik"',
        [
            "[run] select_metric",
            "no evaluator reports 'eval/exact-loglik/val_loglik' (did you mean 'eval/exact-loglik/test_loglik'?)",
        ],
    ),
    (
        "absent cuda device",
        SMALL_RECIPE,
        "seed = 7",
        'seed = 7\ndevice = "cuda:7"',
        ["[run] device", "cuda:7 requested"],
    ),
]


@pytest.mark.parametrize("name, base, old, new, fragments", DRY_CASES, ids=[c[0] for c in DRY_CASES])
def test_validate_rejects_what_run_would_reject_before_its_first_step(
    cli, write_recipe, tmp_path, name, base, old, new, fragments
):
    if name == "absent cuda device" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    assert old in base
    path = write_recipe(base.replace(old, new))
    for command in (["validate", path], ["run", path, "--out", tmp_path / "runs"]):
        line = one_line_error(cli(command))
        assert str(path) in line
        for fragment in fragments:
            assert fragment in line, line
    assert not (tmp_path / "runs").exists(), "a rejected run leaves no run directory"


@pytest.mark.slow
def test_validate_accepts_every_bundled_recipe_and_comparison_spec(cli):
    root = RECIPES
    files = sorted(root.glob("*.toml")) + sorted((root / "compare").glob("*.toml"))
    result = cli(["validate", *files])
    assert result.exit_code == 0, result.output
    assert result.output.count("ok: ") == len(files)
    # Frey face recipes are checked with stand-in images when the file is absent, and say so
    assert "checked with stand-in images" in result.output


def test_validate_check_data_requires_the_files(cli):
    recipe = RECIPES / "freyface_dsm.toml"
    result = cli(["validate", recipe, "-o", "data.root=/nonexistent", "--check-data"])
    assert result.exit_code == 2 and "/nonexistent/frey_rawface.mat" in result.output


# ---- build, measure, dry_run ------------------------------------------------------------------------


def small():
    import tomllib

    import eblvm

    return eblvm.load_recipe(tomllib.loads(BISM))


def test_build_places_every_part_and_makes_the_estimators_roles():
    from eblvm_core.build import build

    built = build(small(), "cpu")
    assert built.device == built.plan.device == torch.device("cpu")
    assert sorted(built.roles) == sorted(built.parts.estimator.roles) == ["model", "posterior"]
    assert built.parts.data.train.dtype == torch.float32 and built.parts.data.train.shape == (2000, 2)
    assert [name for name, _ in built.evaluators] == ["exact-loglik"]
    model_params = {id(p) for p in built.parts.model.parameters()}
    assert {id(p) for p in built.roles["model"].params} == model_params


def test_measuring_the_networks_puts_every_rng_back():
    import random

    import numpy as np

    from eblvm_core.build import measure

    recipe = small()
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    expected = (torch.rand(2), random.random(), np.random.rand())
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    sizes = measure(recipe)
    assert (torch.equal(torch.rand(2), expected[0]), random.random(), np.random.rand()) == (True, *expected[1:])
    from eblvm_core.build import build

    networks = build(recipe, "cpu").parts.networks()
    assert set(networks) == {"model", "posterior"}
    assert sizes.parameters == sizes.trainable == sum(p.numel() for net in networks.values() for p in net.parameters())


def test_dry_run_builds_without_moving_the_global_rng_and_returns_the_warnings(write_recipe):
    from eblvm_core.build import dry_run

    state = torch.get_rng_state()
    assert dry_run(write_recipe(SMALL_RECIPE)) == []
    assert torch.equal(torch.get_rng_state(), state)


def test_a_dry_run_makes_the_data_and_networks_once_as_a_runs_build_would(monkeypatch):
    """The plan weighs the networks; the dry run builds with those it weighed (made from the seed),
    not a second set: the same parameters as a build from the recipe's seed."""
    from eblvm_core import build as building
    from eblvm_core import checkpoint as ckpt

    recipe = small()
    made, built = [], []
    early, build = building._early, building.build
    monkeypatch.setattr(building, "_early", lambda *args: made.append(early(*args)) or made[-1])
    monkeypatch.setattr(building, "build", lambda *args, **kw: built.append(build(*args, **kw)) or built[-1])
    building.dry_run(recipe)
    assert len(made) == 1 and len(built) == 1
    ckpt.seed_everything(recipe.run.seed)
    expected = build(recipe, "cpu").parts.networks()
    got = built[0].parts.networks()
    assert set(got) == set(expected) == {"model", "posterior"}
    for name, network in expected.items():
        for (key, want), have in zip(network.state_dict().items(), got[name].state_dict().values(), strict=True):
            assert torch.equal(have, want), f"{name}.{key}"


# ---- _make: what a factory may fail with --------------------------------------------------------------


@attrs.frozen
class Sizes:
    n_hidden: int = 4
    widths: list = [8, 4000]
    depth: int = 2
    flag: bool = True


def section_of(factory, of_kind: str = "models", config=None):
    from eblvm_core.recipe import Section

    entry = SimpleNamespace(factory=factory, of_kind=of_kind, name="toy", plugin="eblvm_toy")
    return Section("model", entry, config if config is not None else Sizes())


def test_a_size_torch_cannot_build_is_a_config_error_naming_the_likely_key():
    from eblvm_core.build import _make, _suspect_key

    assert _suspect_key(Sizes()) == "widths" and _suspect_key(Sizes(depth=-1)) == "depth"

    def huge(config, parts):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: 99 GB")

    with pytest.raises(ConfigError) as refused:
        _make(section_of(huge), None)
    assert str(refused.value).startswith("[model] widths: cannot be built at this size: [enforce fail")

    def bug(config, parts):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="mat1 and mat2"):
        _make(section_of(bug), None)


def test_a_factory_error_names_its_section_and_a_wrong_product_names_the_plugin():
    from eblvm_core.build import _make
    from eblvm_core.errors import DataError

    def unreadable(config, parts):
        raise DataError("no such folder", key="root")

    with pytest.raises(ConfigError, match=r"^\[model\] root: no such folder$"):
        _make(section_of(unreadable), None)

    def unnamed(config, parts):
        raise ConfigError("", "n_hidden", "must be even")

    with pytest.raises(ConfigError, match=r"^\[model\] n_hidden: must be even$"):
        _make(section_of(unnamed), None)

    def wrong(config, parts):
        return "a string"

    with pytest.raises(
        ConfigError,
        match=r"\[model\] kind: 'toy' of plugin 'eblvm_toy': its factory .*wrong returned a str, not an EnergyModel",
    ):
        _make(section_of(wrong), None)
    assert _make(section_of(lambda config, parts: len, of_kind="evaluators"), None) is len


def test_the_reported_keys_are_the_evaluators_registrations():
    assert small().reported_keys() == {"eval/exact-loglik/test_loglik", "eval/exact-loglik/test_loglik_stderr"}


def test_validate_and_run_refuse_a_factory_of_the_wrong_type_naming_plugin_kind_and_factory(
    cli, write_recipe, tmp_path, monkeypatch
):
    """A plugin whose model factory returns a dict: validate finds it (it builds every component)
    and run stops before a run directory exists, in one line each."""
    import sys

    from eblvm_core import plugins

    (tmp_path / "eblvm_wrongtype.py").write_text(
        "import attrs\n"
        "from eblvm.plugin import NoConfig, hookimpl\n\n"
        "def build_wrong(config, parts):\n"
        "    '''A model that is not one.'''\n"
        "    return {'not': 'a model'}\n\n"
        "@hookimpl\n"
        "def register_models(register):\n"
        "    register('wrong', build_wrong, NoConfig)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("EBLVM_PLUGIN_MODULES", "eblvm_wrongtype")
    monkeypatch.setattr(plugins, "_loaded", None)
    monkeypatch.delitem(sys.modules, "eblvm_wrongtype", raising=False)
    recipe = write_recipe(SMALL_RECIPE.replace('kind = "grbm"\nn_hidden = 4', 'kind = "wrong"'))
    expected = (
        "[model] kind: 'wrong' of plugin 'eblvm_wrongtype': its factory build_wrong returned a dict, not an EnergyModel"
    )
    for args in (["validate", recipe], ["run", recipe, "--out", tmp_path / "runs"]):
        result = cli(args)
        assert result.exit_code == 2 and expected in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "runs").exists()
