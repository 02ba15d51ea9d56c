"""The Python API (``import eblvm``): ``train`` takes a path, a dict or a Recipe and trains through
the command line's own code path (the same parameters to the bit, the same final metrics, run
directory, threads and provenance); ``load`` gives the parts of a saved run, and its ``evaluate``
and ``sample`` give what ``eblvm eval`` and ``eblvm sample`` give."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

import eblvm
from eblvm_core import checkpoint as ckpt
from eblvm_core.errors import ConfigError, EblvmError
from tests.support import BISM, ROOT, SMALL_RECIPE, assert_same_parameters, metrics_rows, only_run_dir, same_tensors
from tests.support.forked import Forked

quiet = None  # echo=None: nothing printed


def printed(output: str) -> dict[str, str]:
    """The final metrics `eblvm run` prints: 'name: value' lines before 'done:'."""
    found = {}
    for line in output.splitlines():
        key, sep, value = line.partition(": ")
        if sep and "/" in key and " " not in key:
            found[key] = value
    return found


@pytest.mark.slow
def test_a_recipe_path_trains_as_the_command_line_does(write_recipe, tmp_path):
    """The same recipe file: `python -m eblvm run` in a process of its own and eblvm.train here give
    the same parameters and optimizer state to the bit, and the API returns the printed final metrics."""
    recipe = write_recipe(BISM)
    cli_out = tmp_path / "cli"
    done = Forked(["run", recipe, "--out", cli_out], cwd=ROOT)
    stdout, stderr = done.communicate(timeout=300)
    assert done.returncode == 0, stderr
    run = eblvm.train(recipe, out=tmp_path / "api", echo=quiet)
    assert_same_parameters(only_run_dir(cli_out), run.run_dir)
    shown = printed(stdout)
    assert shown and shown == {k.removeprefix("eval/"): f"{v:.6g}" for k, v in run.metrics.items()}
    final = [r for r in map(json.loads, (run.run_dir / "metrics.jsonl").read_text().splitlines()) if r["step"] == 30]
    assert {k: v for k, v in final[-1].items() if k.startswith("eval/")} == run.metrics
    assert run.run_dir.parent == tmp_path / "api" / "small" and run.status == "finished"


def test_a_dict_recipe_trains_as_its_file_does(cli, write_recipe, tmp_path):
    """TOML-ready data, as tomllib reads the file, with overrides as a mapping: the same
    parameters and metrics as `eblvm run FILE -o ...`, the same resolved recipe.toml, one CPU
    thread for this tiny model as the command line chooses, and torch's setting put back."""
    recipe = write_recipe(SMALL_RECIPE)
    result = cli(["run", recipe, "--out", tmp_path / "cli", "-o", "run.steps=25", "-o", "optim.model.lr=0.02"])
    assert result.exit_code == 0, result.output
    data = tomllib.loads(SMALL_RECIPE)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        run = eblvm.train(data, overrides={"run.steps": 25, "optim.model.lr": 0.02}, out=tmp_path / "api", echo=quiet)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    cli_dir = only_run_dir(tmp_path / "cli")
    assert_same_parameters(cli_dir, run.run_dir)
    assert printed(result.output) == {k.removeprefix("eval/"): f"{v:.6g}" for k, v in run.metrics.items()}
    assert (cli_dir / "recipe.toml").read_text() == (run.run_dir / "recipe.toml").read_text()
    assert data == tomllib.loads(SMALL_RECIPE), "the caller's dict is left as it was"
    session = json.loads((run.run_dir / "run.json").read_text())["sessions"][0]
    assert session["threads"] == 1 and session["command"].startswith("eblvm.train(<recipe dict>, overrides=[")


def test_errors_are_the_command_lines(tmp_path):
    bad = tomllib.loads(SMALL_RECIPE)
    bad["run"]["steps"] = 0
    with pytest.raises(ConfigError, match=r"^<recipe dict>: \[run\] steps: must be > 0"):
        eblvm.train(bad, out=tmp_path, echo=quiet)
    with pytest.raises(ConfigError, match=r"\[optim\.modle\]"):
        eblvm.train(tomllib.loads(SMALL_RECIPE), overrides={"optim.modle.lr": 1.0}, out=tmp_path, echo=quiet)
    with pytest.raises(EblvmError, match="no such directory"):
        eblvm.load(tmp_path / "gone")
    with pytest.raises(ValueError, match="one of them"):
        eblvm.train(tomllib.loads(SMALL_RECIPE), resume=tmp_path)
    with pytest.raises(ValueError, match="one of them"):
        eblvm.train()
    assert not any(tmp_path.iterdir()), "a refused recipe writes nothing"


@pytest.mark.slow
def test_load_gives_the_parts_and_evaluates_and_samples_as_the_commands_do(cli, write_recipe, tmp_path):
    """load(): model, posterior, data and sampler of the saved run; evaluate() equals `eblvm eval`
    (AIS included: seeded alike) and repeats itself; sample(n) equals `eblvm sample`'s raw samples."""
    text = BISM + '\n[[eval]]\nkind = "ais-loglik"\nn_chains = 50\nn_reverse_chains = 20\nn_temps = 50\n'
    run = eblvm.train(tomllib.loads(text), out=tmp_path / "runs", echo=quiet)
    loaded = eblvm.load(run.run_dir, echo=quiet)
    assert loaded.step == 30 and loaded.checkpoint == "last"
    assert loaded.model is loaded.parts.model and loaded.posterior is not None
    assert loaded.data.train.shape == (2000, 2)
    state = ckpt.load(ckpt.last_checkpoint(run.run_dir))["networks"]["model"]
    assert all(torch.equal(p, state[name]) for name, p in loaded.model.state_dict().items())

    result = cli(["eval", run.run_dir])
    assert result.exit_code == 0, result.output
    first = loaded.evaluate(echo=quiet).scalars
    assert printed(result.output) == {k.removeprefix("eval/"): f"{v:.6g}" for k, v in first.items()}
    assert loaded.evaluate(echo=quiet).scalars == first
    assert run.evaluate(echo=quiet).scalars == first
    assert set(run.evaluate(evaluators=["score-loss"], echo=quiet).scalars) == {
        "eval/score-loss/test_score_loss",
        "eval/score-loss/test_score_loss_stderr",
    }
    ais = loaded.evaluate([{"kind": "ais-loglik", "n_chains": 7, "n_temps": 20}], echo=quiet).scalars
    assert 1 <= ais["eval/ais-loglik/log_z_ess"] <= 7

    out = tmp_path / "s.png"
    assert cli(["sample", run.run_dir, "-n", "9", "--out", out]).exit_code == 0
    samples = loaded.sample(9)
    assert samples.shape == (9, 2) and torch.equal(samples, torch.load(tmp_path / "s.pt"))
    assert torch.equal(run.sample(9), samples)
    generator = torch.Generator().manual_seed(0)  # the run's seed, as load() was given
    assert torch.equal(loaded.sampler.sample(loaded.model, 9, generator), samples)


def test_importing_eblvm_is_cheap_and_python_m_eblvm_works():
    code = "import sys, eblvm; assert 'torch' not in sys.modules and 'eblvm_core.plugins' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
    shown = subprocess.run(
        [sys.executable, "-m", "eblvm", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0 and "eval" in shown.stdout and "run" in shown.stdout
    assert {"train", "load", "load_recipe", "Run", "LoadedRun"} <= set(dir(eblvm))
    with pytest.raises(AttributeError):
        eblvm.nope  # noqa: B018


def test_override_values_are_written_as_toml():
    from eblvm.api import override_list

    values = {"a.b": 1e-3, "a.c": "cosine", "a.d": [64, 64], "a.e": {"burn_in": 200, "final_mean": True}, "a.f": 'q"'}
    assert override_list(values) == [
        "a.b=0.001",
        'a.c="cosine"',
        "a.d=[64, 64]",
        'a.e={ "burn_in" = 200, "final_mean" = true }',
        'a.f="q\\""',
    ]
    from eblvm_core.recipe import parse_value

    assert [parse_value(o.partition("=")[2]) for o in override_list(values)] == list(values.values())
    assert override_list("run.steps=3") == ["run.steps=3"]


def test_an_override_value_toml_cannot_hold_is_refused_naming_its_type():
    from eblvm.api import override_list, toml_value

    assert toml_value(True) == "true" and toml_value(Path("a b/c")) == '"a b/c"' and toml_value((1, 2.5)) == "[1, 2.5]"
    for value, name in ((None, "NoneType"), ({1, 2}, "set"), ([1, object()], "object")):
        with pytest.raises(TypeError) as refused:
            override_list({"run.x": value})
        assert str(refused.value) == f"an override value must be a bool, number, string, list or dict, not {name}"


def test_a_run_reads_its_directory(run_copy):
    """``Run``: its resolved recipe, how its last session ended, its rows (a line cut by a kill is
    skipped), the checkpoints it can load, and the final evaluation read back from metrics.jsonl."""
    run = eblvm.Run(run_copy)
    assert repr(run) == f"Run({str(run_copy)!r}, status='finished')"
    assert run.recipe.path == str(run_copy / "recipe.toml") and run.recipe.run.seed == 7 and run.recipe.run.steps == 30
    rows = metrics_rows(run_copy)
    assert run.history() == rows and run.checkpoints() == ["last"]
    assert run.metrics == {k: v for k, v in rows[-1].items() if k.startswith("eval/")} and run.metrics
    with (run_copy / "metrics.jsonl").open("a") as file:
        file.write('{"step": 40, "train/lo')  # killed mid-line
    assert eblvm.Run(run_copy).history() == rows
    (run_copy / "metrics.jsonl").unlink()
    ckpt.last_checkpoint(run_copy).unlink()
    bare = eblvm.Run(run_copy)
    assert bare.history() == [] and bare.metrics == {} and bare.checkpoints() == []


def test_prepared_restores_a_checkpoint_and_steps_on_from_it(trained):
    """``prepare`` then ``restore(last.pt)``: the run's step and parameters, and the next step is
    the one a resumed run takes (the same parameters as resuming for one more step)."""
    prepared = eblvm.prepare(trained / "recipe.toml", echo=quiet)
    saved = ckpt.load(ckpt.last_checkpoint(trained))
    prepared.restore(ckpt.last_checkpoint(trained))
    assert prepared.state.step == 30
    assert same_tensors(prepared.parts.model.state_dict(), saved["networks"]["model"])
    prepared.step()
    assert prepared.state.step == 31
    assert not same_tensors(prepared.parts.model.state_dict(), saved["networks"]["model"])


def test_prepared_fit_trains_as_eblvm_run_does(write_recipe, tmp_path):
    """``Prepared.fit(run_dir)``: the same parameters to the bit and the same final evaluation as
    ``eblvm.train`` of the recipe, with its records written into ``run_dir`` (made) and run.json
    saying it finished."""
    recipe = write_recipe(SMALL_RECIPE.replace("steps = 30", "steps = 20"))
    trained = eblvm.train(recipe, out=tmp_path / "runs", echo=quiet)
    said = []
    prepared = eblvm.prepare(recipe, echo=said.append)
    results = prepared.fit(tmp_path / "prepared")
    assert_same_parameters(trained.run_dir, tmp_path / "prepared")
    assert results == trained.metrics and results
    assert eblvm.Run(tmp_path / "prepared").status == "finished" and eblvm.Run(tmp_path / "prepared").metrics == results
    assert any(line.startswith("step 20/20") for line in said), said
