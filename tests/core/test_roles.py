"""Roles: an estimator with three roles and three optimizers (the test plugin ``tests.support.three_roles``)
trains, logs each role's schedule, checkpoints, resumes after kill -9 bit-identically, evaluates
on EMA weights, and its NaN guard covers every role; validate checks [optim.<role>] sections."""

from __future__ import annotations

import math
import os
import signal
import time

import pytest
import torch

from eblvm_core import checkpoint as ckpt
from eblvm_core import plugins
from eblvm_core.errors import TrainingDiverged
from tests.support import ROOT, metrics_rows
from tests.support.forked import Forked

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
    proc = Forked(["run", recipe, "--out", out], cwd=ROOT, env=env)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not list(out.glob("*/*/checkpoints/last.pt")):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    (killed_dir,) = list(out.glob("*/*"))
    killed_at = ckpt.load(killed_dir / "checkpoints" / "last.pt")["step"]
    assert killed_at < 600, f"the run finished before it could be killed; the test proves nothing ({err[-300:]})"

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


# ---- TrainingRole on its own: the update, the gradient statistics and their checkpoint ------------


def test_an_update_on_given_gradients_steps_only_the_parameters_that_have_one():
    """``update()`` with no loss takes the gradients in ``.grad``: a parameter without one is not
    stepped; the norm returned and counted is that of the gradients given."""
    from eblvm_core.roles import TrainingRole

    a, b = torch.nn.Parameter(torch.tensor([1.0, 2.0])), torch.nn.Parameter(torch.tensor([3.0]))
    role = TrainingRole("model", torch.optim.SGD([a, b], lr=0.5))
    a.grad = torch.tensor([3.0, 4.0])
    norm = role.update()
    assert float(norm) == 5.0 and norm.dim() == 0
    assert a.tolist() == [-0.5, 0.0] and b.tolist() == [3.0] and b.grad is None
    assert role.take_mean_grad_norm() == 5.0


def test_an_update_without_any_gradient_counts_a_zero_norm_and_steps_nothing():
    from eblvm_core.roles import TrainingRole

    p = torch.nn.Parameter(torch.tensor([1.0, -1.0]))
    role = TrainingRole("model", torch.optim.SGD([p], lr=0.5, momentum=0.9))
    norm = role.update()
    assert float(norm) == 0.0 and p.tolist() == [1.0, -1.0] and not role.optimizer.state
    assert role.take_mean_grad_norm() == 0.0  # one update, of norm 0


def test_a_gradient_in_another_memory_layout_is_stepped_in_the_parameters():
    """A channels-last gradient of a contiguous convolution weight is copied into the weight's
    layout before the step (fused Adam needs it), with the same values: the step of the same gradient."""
    from eblvm_core.roles import TrainingRole

    torch.manual_seed(0)
    start, grad = torch.randn(4, 3, 2, 2), torch.randn(4, 3, 2, 2)
    steps = []
    for layout in (torch.contiguous_format, torch.channels_last):
        p = torch.nn.Parameter(start.clone())
        role = TrainingRole("model", torch.optim.Adam([p], lr=0.1))
        p.grad = grad.clone().contiguous(memory_format=layout)
        assert (p.grad.stride() == p.stride()) == (layout is torch.contiguous_format)
        role.update()
        assert p.grad.stride() == p.stride()
        steps.append(p.detach().clone())
    assert torch.equal(steps[0], steps[1]) and not torch.equal(steps[0], start)


def test_under_fp16_an_update_needs_the_loss_to_scale_it():
    from eblvm_core.roles import Precision, TrainingRole

    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    role = TrainingRole("model", torch.optim.SGD([p], lr=0.1), scaler=Precision("fp16", "cpu").scaler())
    with pytest.raises(ValueError, match="^under fp16 a role's update needs the loss, to scale it$"):
        role.update()
    assert p.tolist() == [1.0, 1.0]


def test_the_gradient_statistics_go_through_a_checkpoint_and_only_for_training():
    """(sum, count) of the norms since the last log step are in ``state_dict``; a role that loads it
    to train reports their mean at its next log step; one loaded to evaluate (``training=False``)
    takes neither them nor the optimizer's state. ``take_mean_grad_norm`` starts again from zero."""
    from eblvm_core.roles import TrainingRole

    def role() -> TrainingRole:
        return TrainingRole("model", torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=0.1))

    trained = role()
    (p,) = trained.params
    for loss in ((p - torch.tensor([3.0, 4.0])).square().sum() / 2, (p - torch.tensor([0.0, 1.0])).square().sum()):
        trained.update(loss)
    norms = trained.state_dict()["grad_norms"]
    first = 5.0  # |p - (3, 4)| at p = 0
    assert norms[1] == 2 and norms[0] > first
    resumed, evaluated = role(), role()
    resumed.load_state_dict(trained.state_dict())
    evaluated.load_state_dict(trained.state_dict(), training=False)
    assert resumed.take_mean_grad_norm() == pytest.approx(float(norms[0]) / 2, rel=1e-7)
    assert resumed.take_mean_grad_norm() is None and resumed.state_dict()["grad_norms"].tolist() == [0.0, 0.0]
    assert evaluated.take_mean_grad_norm() is None and not evaluated.optimizer.state
    assert trained.take_mean_grad_norm() == pytest.approx(float(norms[0]) / 2, rel=1e-7)


def test_prepared_state_is_what_the_first_update_starts_from():
    """``prepare_state`` makes Adam's moments and the statistics (zero, nothing counted) and steps
    nothing; the first update after it takes the same step as one without it."""
    from eblvm_core.roles import TrainingRole

    steps = []
    for prepare in (False, True):
        p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
        role = TrainingRole("model", torch.optim.Adam([p], lr=0.1))
        if prepare:
            role.prepare_state()
            assert p.tolist() == [1.0, 2.0] and p.grad is None
            state = role.optimizer.state[p]
            assert float(state["step"]) == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
            assert role.take_mean_grad_norm() is None and len(role.state_tensors()) == 3 + 4
        role.update((p * torch.tensor([1.0, -2.0])).sum())
        steps.append((p.detach().clone(), role.take_mean_grad_norm()))
    assert torch.equal(steps[0][0], steps[1][0]) and steps[0][1] == steps[1][1] == pytest.approx(5**0.5)
