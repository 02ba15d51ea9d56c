"""Plugin discovery, pinning, failure isolation and registries."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import attrs
import pytest

from eblvm_core.errors import ConfigError
from eblvm_core.registry import Registry


def fake_distribution(site: Path, plugin: str, module: str, source: str) -> None:
    """A minimal installed distribution (dist-info with an `eblvm` entry point) in ``site``."""
    info = site / f"{plugin}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {plugin}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[eblvm]\n{plugin} = {module}\n")
    (site / f"{module}.py").write_text(textwrap.dedent(source))


def eblvm(args: list[str], site: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "EBLVM_LOAD_PLUGINS"}
    environ.update(env)
    if site is not None:
        environ["PYTHONPATH"] = os.pathsep.join([str(site), environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "eblvm_core.cli", *args], capture_output=True, text=True, env=environ)


def test_broken_plugin_is_reported_and_the_rest_work(tmp_path):
    fake_distribution(tmp_path, "broken", "eblvm_broken_plugin", "raise ImportError('missing dependency frobnicate')")
    proc = eblvm(["plugins"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "plugin 'broken' failed to load" in proc.stderr and "frobnicate" in proc.stderr
    assert "broken  FAILED" in proc.stdout
    assert "model grbm" in proc.stdout and "dataset checkerboard" in proc.stdout
    recipes = sorted(str(p) for p in Path("recipes").glob("*.toml"))
    assert eblvm(["validate", *recipes], tmp_path).returncode == 0


def test_third_party_plugin_registers_through_the_entry_point_group(tmp_path):
    fake_distribution(
        tmp_path,
        "halfkl",
        "eblvm_halfkl",
        """
        import attrs
        from eblvm_core.config import option, positive
        from eblvm_core.hookspecs import hookimpl

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
    proc = eblvm(["plugins"], tmp_path)
    assert "halfkl  (eblvm_halfkl)" in proc.stdout
    assert "divergence half: A divergence for tests." in proc.stdout
    assert "scale: float = 0.5  multiplier" in proc.stdout


def test_load_plugins_pins_the_set(tmp_path):
    proc = eblvm(["plugins"], None, EBLVM_LOAD_PLUGINS="toy,grbm")
    names = [line.split()[0] for line in proc.stdout.splitlines() if line and not line.startswith(" ")]
    assert names == ["core", "grbm", "toy"]
    proc = eblvm(["plugins"], None, EBLVM_LOAD_PLUGINS="toy,nosuch")
    assert "plugin 'nosuch' failed" in proc.stderr and "not installed" in proc.stderr


def test_misspelt_hook_is_caught(tmp_path):
    fake_distribution(
        tmp_path,
        "typo",
        "eblvm_typo",
        """
        from eblvm_core.hookspecs import hookimpl

        @hookimpl
        def register_model(register):
            pass
    """,
    )
    proc = eblvm(["plugins"], tmp_path)
    assert proc.returncode == 0
    assert "plugin 'typo' failed" in proc.stderr and "register_model" in proc.stderr


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


def test_a_third_party_plugin_cannot_take_over_a_bundled_name(tmp_path):
    """Bundled plugins register first; a plugin sorted before them ('aaa') that registers 'grbm'
    fails, naming both plugins, and what it registered before failing is withdrawn."""
    fake_distribution(
        tmp_path,
        "aaa",
        "eblvm_aaa",
        """
        from eblvm_core.hookspecs import hookimpl

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


def test_a_plugin_that_exits_at_import_is_reported_like_any_failing_plugin(tmp_path):
    fake_distribution(tmp_path, "quitter", "eblvm_quitter", "import sys\nsys.exit(3)")
    proc = eblvm(["plugins"], tmp_path)
    assert proc.returncode == 0 and "plugin 'quitter' failed" in proc.stderr and "SystemExit" in proc.stderr


def test_a_plugin_command_cannot_replace_a_built_in_one(tmp_path):
    fake_distribution(
        tmp_path,
        "hijack",
        "eblvm_hijack",
        """
        from eblvm_core.hookspecs import hookimpl

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


def test_two_plugins_cannot_share_a_command_name(tmp_path):
    """The first plugin (in load order) keeps the name; the second is told, naming both."""
    for plugin in ("first", "second"):
        source = (
            "from eblvm_core.hookspecs import hookimpl\n\n"
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


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["validate", "--help"], ["compare", "--help"]])
def test_help_imports_neither_torch_nor_plugins(args):
    """What makes `eblvm --help` start in a fraction of a second (0.2 s measured, 3 s before)."""
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
