"""The experiments plugin as a plugin: what it registers (commands, launchers, spec readers) goes
when ``EBLVM_LOAD_PLUGINS`` leaves it out; ``compare`` and ``search`` take the launcher's
options (``SlurmConfig``'s fields) from the arguments they pass on, list them in their help and
refuse them without a cluster launcher."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tests.support import SMALL_RECIPE, one_line_error

SPEC = '[[method]]\nname = "A"\nrecipe = "r.toml"\n'


@pytest.fixture
def spec(tmp_path, write_recipe):
    write_recipe(SMALL_RECIPE)
    path = tmp_path / "spec.toml"
    path.write_text(SPEC)
    return path


@pytest.fixture
def plugin_commands():
    """invoke(args) -> click Result of the plugin's own typer app (its commands with their settings)."""
    from eblvm_experiments.commands import commands

    runner = CliRunner()
    return lambda args: runner.invoke(commands, [str(a) for a in args])


def test_leaving_experiments_out_of_eblvm_load_plugins_leaves_no_compare(cli, spec, monkeypatch):
    from eblvm_core.plugins import load

    monkeypatch.setenv("EBLVM_LOAD_PLUGINS", "toy,grbm")
    try:
        loaded = load(force=True, warn=False)
        assert "experiments" not in {info.name for info in loaded.plugins}
        assert not {c.name for c in loaded.commands} & {"compare", "search"}
        assert loaded["launchers"].names() == [] and loaded["spec_readers"].names() == []
        result = cli(["validate", spec])  # read as a recipe: no reader knows a spec
        assert result.exit_code == 2 and f"error: {spec}: [method]: unknown section" in result.output, result.output
    finally:
        monkeypatch.delenv("EBLVM_LOAD_PLUGINS")
        loaded = load(force=True, warn=False)
    assert {"compare", "search"} <= {c.name for c in loaded.commands}  # the control
    assert loaded["launchers"].names() == ["slurm", "submitit-local"]
    assert loaded["spec_readers"].names() == ["compare", "search"]


@pytest.mark.parametrize("command", ["compare", "search"])
def test_a_cluster_option_of_compare_or_search_without_a_cluster_launcher_is_refused(cli, spec, command):
    line = one_line_error(cli([command, spec, "--partition", "gpu"]))
    assert "--partition is an option of a cluster job: add --launcher slurm" in line, line
    line = one_line_error(cli([command, spec, "--launcher", "pbs"]))
    assert "--launcher must be local, slurm, submitit-local, got 'pbs'" in line, line


@pytest.mark.parametrize("command", ["compare", "search"])
def test_compare_and_search_list_the_launchers_options_in_their_help(cli, command):
    result = cli([command, "--help"])
    assert result.exit_code == 0, result.output
    for flag in ("--partition", "--time", "--array-parallelism", "--sbatch", "--signal-delay"):
        assert flag in result.output, flag


@pytest.mark.parametrize("command", ["compare", "search"])
def test_the_plugins_commands_read_the_launchers_options_from_what_they_pass_on(plugin_commands, spec, command):
    """The commands as declared (their typer settings): a cluster option is refused without a
    cluster launcher, naming the first in SlurmConfig's order; a bad value or an unknown option is
    a usage error; the help lists them."""
    result = plugin_commands([command, spec, "--mem", "8G", "--partition", "gpu"])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and lines == ["error: --partition is an option of a cluster job: add --launcher slurm"]
    result = plugin_commands([command, spec, "--launcher", "slurm", "--nodes", "0"])
    assert result.exit_code == 2 and "Invalid value for '--nodes'" in result.output, result.output
    result = plugin_commands([command, spec, "--launcher", "slurm", "--partitoin", "gpu"])
    assert result.exit_code == 2 and "No such option '--partitoin'" in result.output, result.output
    help_text = plugin_commands([command, "--help"]).output
    assert "--array-parallelism: jobs of a comparison's array" in help_text, help_text


def test_the_launchers_options_arrive_as_a_launcher_tables_keys():
    from eblvm_experiments.commands import cluster_options

    options = cluster_options(
        "slurm",
        ["--time", "90", "--sbatch", "account=proj", "--sbatch", "exclusive", "--setup", "module load cuda"],
        "eblvm compare",
    )
    assert options == {"time": 90, "sbatch": {"account": "proj", "exclusive": True}, "setup": ["module load cuda"]}
    assert cluster_options("local", [], "eblvm compare") == {}
