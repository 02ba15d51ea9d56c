"""Plugin discovery, pinning, failure isolation and registries."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import attrs
import pytest

from eblvm.testing import linear_gaussian_parts
from eblvm_core.config import structure
from eblvm_core.contracts import Evaluator
from eblvm_core.errors import ConfigError
from eblvm_core.plugins import load
from eblvm_core.registry import KIND_NAMES, Registry
from tests.support import ROOT, SMALL_RECIPE


def fake_distribution(site: Path, plugin: str, module: str, source: str) -> None:
    """A minimal installed distribution (dist-info with an `eblvm` entry point) in ``site``."""
    info = site / f"{plugin}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {plugin}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[eblvm]\n{plugin} = {module}\n")
    (site / f"{module}.py").write_text(textwrap.dedent(source))


def eblvm_process(args: list[str], site: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    """``python -m eblvm_core.cli ARGS`` in a fresh interpreter, with ``site`` on its path."""
    environ = {k: v for k, v in os.environ.items() if k != "EBLVM_LOAD_PLUGINS"}
    environ.update(env)
    if site is not None:
        environ["PYTHONPATH"] = os.pathsep.join([str(site), environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "eblvm_core.cli", *args], capture_output=True, text=True, env=environ)


@attrs.frozen
class Ran:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def eblvm(monkeypatch, capsys):
    """``eblvm(args, site=None, **env) -> Ran``: the command line's ``main`` in this process, with
    ``site`` (a folder of installed distributions) on the path and ``env`` set, plugins loaded
    afresh; the plugin set, the app's commands and the SIGINT handler are put back afterwards.
    What a fresh interpreter adds is checked once, by the real-process test below."""
    from eblvm_core import cli, plugins

    handler = signal.getsignal(signal.SIGINT)

    def run(args: list[str], site: Path | None = None, **env: str) -> Ran:
        monkeypatch.delenv("EBLVM_LOAD_PLUGINS", raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        if site is not None:
            monkeypatch.syspath_prepend(str(site))
        monkeypatch.setattr(plugins, "_loaded", None)
        monkeypatch.setattr(cli.app, "registered_commands", list(cli.app.registered_commands))
        monkeypatch.setattr(sys, "argv", ["eblvm", *args])
        capsys.readouterr()
        try:
            cli.main()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        finally:
            signal.signal(signal.SIGINT, handler)
        out = capsys.readouterr()
        return Ran(code, out.out, out.err)

    return run


@pytest.mark.slow
def test_broken_plugin_is_reported_and_the_rest_work(eblvm, tmp_path):
    fake_distribution(tmp_path, "broken", "eblvm_broken_plugin", "raise ImportError('missing dependency frobnicate')")
    proc = eblvm(["plugins"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "plugin 'broken' failed to load" in proc.stderr and "frobnicate" in proc.stderr
    assert "broken  FAILED" in proc.stdout
    assert "model grbm" in proc.stdout and "dataset checkerboard" in proc.stdout
    recipes = sorted(str(p) for p in Path("recipes").glob("grbm_*.toml"))  # every GRBM estimator's plugin
    assert eblvm(["validate", *recipes], tmp_path).returncode == 0
    recipe = tmp_path / "r.toml"
    recipe.write_text(SMALL_RECIPE.replace("steps = 30", "steps = 2"))
    assert eblvm(["run", str(recipe), "--out", str(tmp_path / "runs")], tmp_path).returncode == 0
    (run_dir,) = (tmp_path / "runs").glob("*/*/")  # the failure is in the run's records, not just the console
    (failed,) = json.loads((run_dir / "run.json").read_text())["sessions"][0]["plugins_failed"].items()
    assert failed[0] == "broken" and "frobnicate" in failed[1]
    assert f"plugin 'broken' failed to load and was skipped: {failed[1]}" in (run_dir / "run.log").read_text()


@pytest.mark.slow
def test_third_party_plugin_registers_through_the_entry_point_group(tmp_path):
    fake_distribution(
        tmp_path,
        "halfkl",
        "eblvm_halfkl",
        """
        import attrs
        from eblvm.plugin import hookimpl, option, positive

        @attrs.frozen
        class HalfConfig:
            scale: float = option(0.5, "multiplier", positive)

        def half(cfg, parts):
            '''A divergence for tests.'''
            return None

        @hookimpl
        def register_divergences(register):
            register("half", half, HalfConfig)
    """,
    )
    proc = eblvm_process(["plugins"], tmp_path)
    assert "halfkl  (eblvm_halfkl)" in proc.stdout
    assert "divergence half: A divergence for tests." in proc.stdout
    assert "scale: float = 0.5  multiplier" in proc.stdout


@pytest.mark.slow
def test_load_plugins_pins_the_set(eblvm, tmp_path):
    proc = eblvm(["plugins"], None, EBLVM_LOAD_PLUGINS="toy,grbm")
    names = [line.split()[0] for line in proc.stdout.splitlines() if line and not line.startswith(" ")]
    assert names == ["core", "grbm", "toy"]  # the core's own, always; experiments is a plugin as the others
    proc = eblvm_process(
        ["compare", "--help"], None, EBLVM_LOAD_PLUGINS="toy,grbm"
    )  # a fresh app: no plugin commands yet
    assert proc.returncode == 2 and "No such command 'compare'" in proc.stderr
    proc = eblvm(["plugins"], None, EBLVM_LOAD_PLUGINS="toy,nosuch")
    assert proc.returncode == 2 and proc.stdout == ""
    assert (
        proc.stderr.startswith("error: EBLVM_LOAD_PLUGINS names 'nosuch', not installed")
        and proc.stderr.count("\n") == 1
    )
    proc = eblvm(["validate", ROOT / "recipes" / "grbm_dsm.toml"], None, EBLVM_LOAD_PLUGINS="toy,grbm,nosuch")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr  # nothing after the one line


def test_misspelt_hook_is_caught(eblvm, tmp_path):
    fake_distribution(
        tmp_path,
        "typo",
        "eblvm_typo",
        """
        from eblvm.plugin import hookimpl

        @hookimpl
        def register_model(register):
            pass

        @hookimpl
        def register_divergence(register):
            pass
    """,
    )
    proc = eblvm(["plugins"], tmp_path)
    assert proc.returncode == 0
    assert "plugin 'typo' failed" in proc.stderr
    for typo, hook in (("register_model", "register_models"), ("register_divergence", "register_divergences")):
        why = f"unknown hook '{typo}' (did you mean '{hook}'?)"
        assert why in proc.stderr and why in proc.stdout.split("typo  FAILED: ")[1]


def test_registry_did_you_mean_and_duplicates():
    @attrs.frozen
    class Cfg:
        x: int = 1

    reg = Registry("models")
    reg.add("grbm", lambda c, p: None, Cfg)
    reg.add("resnet", lambda c, p: None, Cfg)
    with pytest.raises(ConfigError) as err:
        reg.get("grmb", section="model")
    assert "did you mean 'grbm'" in str(err.value) and "valid: grbm, resnet" in str(err.value)
    with pytest.raises(ValueError, match="registered twice"):
        reg.add("grbm", lambda c, p: None, Cfg)
    with pytest.raises(TypeError, match="attrs class"):
        reg.add("bad", lambda c, p: None, dict)


def test_a_third_party_plugin_cannot_take_over_a_bundled_name(eblvm, tmp_path):
    """Bundled plugins register first; a plugin sorted before them ('aaa') that registers 'grbm'
    fails, naming both plugins, and what it registered before failing is withdrawn."""
    fake_distribution(
        tmp_path,
        "aaa",
        "eblvm_aaa",
        """
        from eblvm.plugin import hookimpl

        def mine(cfg, parts):
            '''Not the GRBM.'''

        @hookimpl
        def register_datasets(register):
            register("aaa-data", mine)

        @hookimpl
        def register_models(register):
            register("grbm", mine)
    """,
    )
    proc = eblvm(["plugins"], tmp_path)
    assert "plugin 'aaa' failed" in proc.stderr and "'grbm' registered twice (by grbm and aaa)" in proc.stderr
    assert "aaa  FAILED" in proc.stdout and "aaa-data" not in proc.stdout
    assert "model grbm: Gaussian RBM" in proc.stdout


def test_a_plugin_that_exits_at_import_is_reported_like_any_failing_plugin(eblvm, tmp_path):
    fake_distribution(tmp_path, "quitter", "eblvm_quitter", "import sys\nsys.exit(3)")
    proc = eblvm(["plugins"], tmp_path)
    assert proc.returncode == 0 and "plugin 'quitter' failed" in proc.stderr and "SystemExit" in proc.stderr


def test_a_plugin_command_cannot_replace_a_built_in_one(eblvm, tmp_path):
    fake_distribution(
        tmp_path,
        "hijack",
        "eblvm_hijack",
        """
        from eblvm.plugin import hookimpl

        def run():
            '''Not eblvm's run.'''
            print("hijacked")

        def hello():
            '''A plugin command.'''
            print("hello from hijack")

        @hookimpl
        def register_commands(register):
            register(run)
            register(hello)
    """,
    )
    proc = eblvm(["hello"], tmp_path)
    assert proc.returncode == 0 and "hello from hijack" in proc.stdout
    assert "registers a command 'run', which is eblvm's own; ignored" in proc.stderr
    proc = eblvm(["run", "--help"], tmp_path)
    assert "hijacked" not in proc.stdout and "Train a model as a recipe says" in proc.stdout


def test_two_plugins_cannot_share_a_command_name(eblvm, tmp_path):
    """The first plugin (in load order) keeps the name; the second is told, naming both."""
    for plugin in ("first", "second"):
        source = (
            "from eblvm.plugin import hookimpl\n\n"
            "def hello():\n"
            "    '''A plugin command.'''\n"
            f"    print('hello from {plugin}')\n\n"
            "@hookimpl\n"
            "def register_commands(register):\n"
            "    register(hello)\n"
        )
        fake_distribution(tmp_path, plugin, f"eblvm_{plugin}", source)
    proc = eblvm(["hello"], tmp_path)
    assert proc.returncode == 0 and "hello from first" in proc.stdout, proc.stdout + proc.stderr
    assert "plugin 'second' registers a command 'hello', which plugin 'first' registered first" in proc.stderr


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["validate", "--help"], ["eval", "--help"]])
def test_help_imports_neither_torch_nor_plugins(args):
    """What makes `eblvm --help` and the help of eblvm's own commands start in a fraction of a
    second (0.2 s measured, 3 s before); a plugin's command is found by loading the plugins."""
    code = (
        "import sys\n"
        f"sys.argv = ['eblvm', *{args!r}]\n"
        "from eblvm_core.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith('eblvm_') and m != 'eblvm_core' "
        "and not m.startswith('eblvm_core.'))\n"
        "print('HEAVY', heavy)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "Usage" in proc.stdout and "HEAVY []" in proc.stdout, proc.stdout[-500:] + proc.stderr[-500:]


# ---- what `eblvm plugins` says of each component ----------------------------------------------------


LOADED = load()
ENTRIES = [(kind, name) for kind in KIND_NAMES for name in LOADED[kind].names()]


@pytest.mark.parametrize("kind, name", ENTRIES, ids=[f"{k}-{n}" for k, n in ENTRIES])
def test_every_description_is_whole_sentences(kind, name):
    """The description is the factory docstring's whole first paragraph, so it ends a sentence
    ('.', '!' or '?', maybe inside closing brackets or quotes), never mid-sentence as the first
    line of a wrapped paragraph does."""
    doc = LOADED[kind].get(name).doc
    assert re.search(r"[.!?][)\]\"'’”]*$", doc), f"{kind[:-1]} '{name}': description ends mid-sentence: {doc!r}"


def test_a_docstring_gives_the_description_and_the_registration_the_reported_keys(eblvm, tmp_path):
    """A third-party evaluator's first paragraph, wrapped over two lines, is its description in
    full; the keys its registration declares are listed with ``{split}`` at the option's default
    (a ``Reports:`` paragraph is only text); an evaluator that declares nothing gets no reports line."""
    fake_distribution(
        tmp_path,
        "probe",
        "eblvm_probe",
        """
        import attrs
        from eblvm_core.config import option
        from eblvm.plugin import hookimpl

        @attrs.frozen
        class ProbeConfig:
            split: str = option("val", "the split probed")

        def probe(cfg, parts):
            '''A probe whose description runs
            over two lines.

            Reports: nothing_parsed
            '''

        def quiet(cfg, parts):
            '''An evaluator that declares no keys.'''

        @hookimpl
        def register_evaluators(register):
            register("probe", probe, ProbeConfig, reports=("{split}_score", "n_points"))
            register("quiet", quiet)
    """,
    )
    proc = eblvm(["plugins"], tmp_path, EBLVM_LOAD_PLUGINS="probe")
    assert proc.returncode == 0 and "FAILED" not in proc.stdout, proc.stdout + proc.stderr
    block = proc.stdout.split("probe  (eblvm_probe)\n")[1]
    assert block.splitlines()[:3] == [
        "  evaluator probe: A probe whose description runs over two lines.",
        "      reports: val_score, n_points",
        "      split: str = 'val'  the split probed",
    ]
    assert block.splitlines()[3:] == ["  evaluator quiet: An evaluator that declares no keys."]


def test_reported_keys_follow_the_config_and_bad_templates_are_refused():
    @attrs.frozen
    class Cfg:
        n: int  # required: its template stays as written
        split: str = "test"

    def evaluator(cfg, parts):
        """Something.

        Reports: z
        """

    reg = Registry("evaluators")
    reg.add("e", evaluator, Cfg, reports=["{split}_x", "x_{n}", "y"])
    reg.add("undeclared", evaluator, Cfg)
    entry = reg.get("e")
    assert entry.doc == "Something." and entry.reports == ("{split}_x", "x_{n}", "y")
    assert entry.reported_keys() == ("test_x", "x_{n}", "y")
    assert entry.reported_keys(Cfg(3, "val")) == ("val_x", "x_3", "y")
    assert reg.get("undeclared").reports is None  # the docstring's paragraph declares nothing
    with pytest.raises(TypeError, match=r"names \{splt\}, not an option of Cfg \(did you mean 'split'\?\)"):
        reg.add("misspelt", evaluator, Cfg, reports=["{splt}_x"])
    with pytest.raises(TypeError, match="without spaces"):
        reg.add("spaced", evaluator, Cfg, reports=["x y"])
    assert reg.names() == ["e", "undeclared"]


# Evaluators whose keys no template can declare, and why.
UNDECLARED = {
    "gradient-bias": "one key bias_K{K}_N{N} per pair of items of its list options inner_steps and unroll_steps"
}


def build_evaluator(name: str, options: dict) -> tuple[object, object]:
    """(config, evaluator) of ``name`` built as `eblvm validate` does on the first small setup of
    tests/core/test_contracts.py that it accepts."""
    from tests.core.test_contracts import base_parts, bidvl_parts, deep_image_parts, image_grbm_parts

    entry = LOADED["evaluators"].get(name)
    config = structure(entry.config, options, "eval")
    setups = (base_parts, lambda: linear_gaussian_parts()[2], image_grbm_parts, deep_image_parts, bidvl_parts)
    refusals = []
    for make_parts in setups:
        parts = make_parts()
        parts.dry_run = True
        try:
            return config, entry.factory(config, parts)
        except ConfigError as exc:
            refusals.append(str(exc))
    pytest.fail(f"evaluator '{name}' refuses every setup: {refusals}")


@pytest.mark.parametrize("name", LOADED["evaluators"].names())
def test_declared_reports_are_what_the_built_evaluator_reports(name):
    """What `eblvm plugins` lists, without building, is the ``reports`` of the evaluator built
    with the default options, and with split = "train" where there is a split option."""
    entry = LOADED["evaluators"].get(name)
    split = attrs.fields_dict(entry.config).get("split")
    variants = [{}] if split is None or split.default == "train" else [{}, {"split": "train"}]
    for options in variants:
        config, evaluator = build_evaluator(name, options)
        built = evaluator.reports if isinstance(evaluator, Evaluator) else None
        if entry.reports is None:
            assert not built or name in UNDECLARED, (
                f"evaluator '{name}' reports {list(built)} but its registration declares no reports"
            )
        else:
            assert built is not None, f"evaluator '{name}' declares keys but its built evaluator has no reports"
            assert sorted(entry.reported_keys(config)) == sorted(built), (
                f"evaluator '{name}' with {options or 'its defaults'}: its registration declares "
                f"{list(entry.reported_keys(config))}, the built evaluator reports {list(built)}"
            )


# ---- `eblvm sample` names its sampler ----------------------------------------------------------------


def loaded_run(text: str, tmp_path: Path):
    """A LoadedRun of a recipe built on the CPU, untrained (pick_sampler reads only the recipe and parts)."""
    from eblvm_core.build import build
    from eblvm_core.recipe import validate
    from eblvm_core.saved import LoadedRun

    recipe = validate(tomllib.loads(text), "<test>")
    return LoadedRun(tmp_path, recipe, build(recipe, "cpu"), 0, "last", 0)


@pytest.mark.parametrize(
    "extra, label",
    [
        ("", "gibbs (defaults)"),
        ('[[eval]]\nkind = "sample-grid"\nsampler_options = { burn_in = 5 }\n', "gibbs ([eval.1] sample-grid)"),
        ('[sampler]\nkind = "gibbs"\nburn_in = 5\n', "gibbs ([sampler])"),
    ],
    ids=["defaults", "eval", "section"],
)
def test_the_sampler_label_names_the_sampler_and_where_its_settings_come_from(extra, label, tmp_path):
    from eblvm_core.saved import pick_sampler

    digits = 'kind = "digits"\n'  # images, which sample-grid draws
    recipe = SMALL_RECIPE.replace('kind = "checkerboard"\nn_train = 2000\nn_test = 500\n', digits) + "\n" + extra
    sampler, source = pick_sampler(loaded_run(recipe, tmp_path))
    assert source == label
    assert sampler.cfg.burn_in == (1000 if label.endswith("(defaults)") else 5)


def test_sample_prints_the_default_samplers_name(cli, write_recipe, tmp_path):
    recipe = SMALL_RECIPE.replace("steps = 30", "steps = 2").replace("n_train = 2000", "n_train = 100")
    out = tmp_path / "runs"
    assert cli(["run", write_recipe(recipe), "--out", out, "--device", "cpu"]).exit_code == 0
    ((run_dir,),) = [list(p.iterdir()) for p in out.iterdir()]
    result = cli(["sample", run_dir, "-n", "4", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "4 samples (step 2, sampler gibbs (defaults)) -> " in result.output
