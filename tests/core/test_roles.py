"""Roles: an estimator with three roles and three optimizers (the test plugin ``tests.support.three_roles``)
trains, logs each role's schedule, checkpoints, resumes after kill -9 bit-identically, evaluates
on EMA weights, and its NaN guard covers every role; validate checks [optim.<role>] sections."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from eblvm_core import checkpoint as ckpt
from eblvm_core import plugins
from eblvm_core.errors import TrainingDiverged
from tests.support import ROOT, metrics_rows

RECIPE = """
log = []

[run]
name = "roles"
seed = 3
steps = 40
batch_size = 50
log_every = 5
checkpoint_every = 5

[data]
kind = "checkerboard"
n_train = 1000
n_test = 200

[model]
kind = "toy-energy"

[posterior]
kind = "gaussian"
latent_dim = 2
hidden = [16]

[generator]
kind = "toy-generator"
latent_dim = 2

[estimator]
kind = "toy-three-roles"

[optim.energy]
kind = "adam"
lr = 1e-2

[optim.energy.schedule]
kind = "cosine"
warmup_steps = 5
min_lr = 1e-4

[optim.encoder]
kind = "adam"
lr = 5e-3

[optim.encoder.schedule]
kind = "exponential"
gamma = 0.5
every = "epoch"

[optim.generator]
kind = "sgd"
lr = 1e-2

[optim.generator.schedule]
kind = "exponential"
gamma = 0.9
every = "step"

[[eval]]
kind = "generator-norm"
"""


@pytest.fixture(autouse=True)
def three_roles_plugin(monkeypatch):
    monkeypatch.setenv("EBLVM_PLUGIN_MODULES", "tests.support.three_roles")
    monkeypatch.setattr(plugins, "_loaded", None)  # the real registry comes back after the test
    loaded = plugins.load(force=True)
    assert "tests.support.three_roles" in [p.name for p in loaded.plugins], loaded.failed


def train(write_recipe, tmp_path, *overrides, name="r.toml"):
    from tests.support import session_run as run

    return run(write_recipe(RECIPE, name), list(overrides), out=tmp_path / "runs", echo=lambda _line: None)


def expected_lr(role: str, t: int) -> float:
    """The closed forms of the recipe's schedules at training step t (0-based): 20 steps per epoch."""
    if role == "energy":
        if t < 5:
            return 1e-2 * (t + 1) / 5
        return 1e-4 + (1e-2 - 1e-4) * 0.5 * (1 + math.cos(math.pi * (t - 5) / (40 - 1 - 5)))
    if role == "encoder":
        return 5e-3 * 0.5 ** (t // 20)
    return 1e-2 * 0.9**t


def test_three_roles_train_log_their_schedules_and_checkpoint(write_recipe, tmp_path):
    run_dir, results = train(write_recipe, tmp_path)
    logged = [r for r in metrics_rows(run_dir) if "train/loss" in r]
    assert [r["step"] for r in logged] == [5, 10, 15, 20, 25, 30, 35, 40]
    for record in logged:
        for role in ("energy", "encoder", "generator"):
            # the rate logged after step s is the one step s used: the schedule at s - 1
            assert record[f"lr/{role}"] == pytest.approx(expected_lr(role, record["step"] - 1), rel=1e-12), (
                role,
                record["step"],
            )
            assert math.isfinite(record[f"train/grad_norm/{role}"]) and record[f"train/grad_norm/{role}"] > 0
    state = ckpt.load(run_dir / "checkpoints" / "last.pt")
    assert set(state["networks"]) == {"model", "posterior", "generator"}
    assert set(state["roles"]) == {"energy", "encoder", "generator"}
    assert state["estimator"] == {"steps": 40} and "eval/generator-norm/norm" in results


@pytest.mark.slow
def test_kill_minus_9_and_resume_is_bit_identical_for_every_role(write_recipe, tmp_path):
    from tests.support import session_run as run

    recipe = write_recipe(
        RECIPE.replace("steps = 40", "steps = 600").replace("checkpoint_every = 5", "checkpoint_every = 20")
    )
    full_dir, _ = run(recipe, out=tmp_path / "full", echo=lambda _line: None)

    out = tmp_path / "killed"
    env = {**os.environ, "EBLVM_PLUGIN_MODULES": "tests.support.three_roles"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "eblvm_core.cli", "run", str(recipe), "--out", str(out)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not list(out.glob("*/*/checkpoints/last.pt")):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    (killed_dir,) = list(out.glob("*/*"))
    killed_at = ckpt.load(killed_dir / "checkpoints" / "last.pt")["step"]
    assert killed_at < 600, (
        f"the run finished before it could be killed; the test proves nothing ({err.decode()[-300:]})"
    )

    run(None, resume=killed_dir, echo=lambda _line: None)
    a, b = ckpt.load(full_dir / "checkpoints" / "last.pt"), ckpt.load(killed_dir / "checkpoints" / "last.pt")
    assert a["step"] == b["step"] == 600
    for section in ("model", "posterior", "generator"):
        for key, value in a["networks"][section].items():
            assert torch.equal(value, b["networks"][section][key]), (section, key)
    for role in ("energy", "encoder", "generator"):
        ours, theirs = a["roles"][role]["optimizer"], b["roles"][role]["optimizer"]
        for index, values in ours["state"].items():
            for key, value in values.items():
                assert torch.equal(value, theirs["state"][index][key]), (role, index, key)
        assert ours["param_groups"][0]["lr"] == theirs["param_groups"][0]["lr"]


@pytest.mark.parametrize(
    "role, parameter",
    [
        ("energy", "model.net.0.weight"),
        ("encoder", "posterior.trunk.1.weight"),
        ("generator", "generator.net.0.weight"),
    ],
)
def test_the_nan_guard_covers_every_role(write_recipe, tmp_path, role, parameter):
    with pytest.raises(TrainingDiverged) as info:
        train(write_recipe, tmp_path, f'estimator.poison_role="{role}"', "estimator.poison_step=10")
    message = str(info.value)
    assert message.startswith("step 10:") and f"parameter {parameter} (role '{role}') is not finite" in message
    assert "(step 5; never evaluated)" in message
    (run_dir,) = list((tmp_path / "runs").glob("*/*"))
    state = ckpt.load(run_dir / "checkpoints" / "last.pt")
    assert state["step"] == 5
    assert all(torch.isfinite(t).all() for net in state["networks"].values() for t in net.values())


def test_evaluators_see_the_ema_of_a_role(write_recipe, tmp_path):
    """With [optim.generator] ema = 0.8 the evaluators (in training and in `eblvm eval`) see the
    averaged generator, which the checkpoint stores beside the live one."""
    from eblvm_core.saved import load_run
    from tests.support import session_run as run

    text = RECIPE.replace('kind = "sgd"\nlr = 1e-2', 'kind = "sgd"\nlr = 1e-2\nema = 0.8')
    run_dir, results = run(write_recipe(text, "ema.toml"), out=tmp_path / "runs", echo=lambda _line: None)
    state = ckpt.load(run_dir / "checkpoints" / "last.pt")
    averaged = torch.cat([t.flatten() for t in state["roles"]["generator"]["ema"]]).norm()
    live = torch.cat([t.flatten() for t in state["networks"]["generator"].values()]).norm()
    assert results["eval/generator-norm/norm"] == pytest.approx(float(averaged), rel=1e-6)
    assert abs(float(averaged) - float(live)) > 1e-4
    loaded = load_run(run_dir)
    assert loaded.evaluate(echo=None).scalars["eval/generator-norm/norm"] == pytest.approx(float(averaged), rel=1e-6)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_runs_and_checkpoints_its_scalers(write_recipe, tmp_path, precision):
    run_dir, results = train(write_recipe, tmp_path, f'run.precision="{precision}"')
    state = ckpt.load(run_dir / "checkpoints" / "last.pt")
    scaled = {name for name, role in state["roles"].items() if "scaler" in role}
    assert scaled == ({"energy", "encoder", "generator"} if precision == "fp16" else set())
    assert all(torch.isfinite(t).all() for net in state["networks"].values() for t in net.values())


# ---- validate: roles --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "old, new, fragments",
    [
        ("optim.encoder", "optim.encodr", ["[optim.encodr]", "unknown role (did you mean 'encoder'?)"]),
        (
            "[optim.encoder.schedule]",
            "[optim.encodr.schedule]",
            ["[optim.encodr] kind", "missing; choose one of: adam, sgd"],
        ),
        (
            '[optim.generator]\nkind = "sgd"\nlr = 1e-2\n\n[optim.generator.schedule]\nkind = "exponential"\ngamma = 0.9\nevery = "step"\n',
            "",
            ["[optim.generator] kind", "missing", "role 'generator'"],
        ),
        ("[optim.energy]\n", "[optim.energy]\nema = 1.5\n", ["[optim.energy] ema", "must be in (0, 1)"]),
        ('kind = "cosine"', 'kind = "cosinus"', ["[optim.energy.schedule] kind", "did you mean 'cosine'"]),
        (
            "[[eval]]",
            '[optim.critic]\nkind = "adam"\n\n[[eval]]',
            ["[optim.critic]", "unknown role", "trains: energy, encoder, generator"],
        ),
    ],
    ids=["misspelt role", "misspelt role with schedule", "missing role", "bad ema", "unknown schedule", "extra role"],
)
def test_validate_checks_optimizer_roles(cli, write_recipe, old, new, fragments):
    assert old in RECIPE
    path = write_recipe(RECIPE.replace(old, new))
    result = cli(["validate", path])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and str(path) in lines[0], result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
