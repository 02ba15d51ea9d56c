"""When a run's training step may be replayed from a CUDA graph (scheduled rates included: they are
read from device tensors), and what the loop around a replayed step keeps on the device: the
gradient-norm log, the metric sums and the NaN guard's sentinel, and the next batch drawn ahead.
The replay itself needs a GPU (tests/e2e/test_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from eblvm_core.build import build
from eblvm_core.checkpoint import seed_everything
from eblvm_core.graphs import optimizer_refusal
from eblvm_core.plan import Launch, Machine, Sizes, make_plan
from eblvm_core.recipe import load_recipe
from eblvm_core.roles import TrainingRole
from tests.support import RECIPES, poison_at

A_GPU = Machine(cuda_devices=1, mps=False)  # only named: the plan decides without touching a device


def refusal(recipe: str, overrides: list[str] = (), device="cuda", world=1, precision="fp32") -> str | None:
    """Why a recipe's step would not be replayed on a machine with a GPU: the plan's verdict, else
    that of the roles' optimizers as built (on the CPU here)."""
    overrides = [*overrides, f'run.device="{device}"', f'run.precision="{precision}"']
    spec = load_recipe(RECIPES / recipe, overrides)
    plan = make_plan(spec, lambda: Sizes(1, 1), A_GPU, Launch(0, world, 0))
    if plan.cuda_graph is not None:
        return plan.cuda_graph
    seed_everything(0)
    return optimizer_refusal(build(spec, "cpu").roles)


@pytest.mark.parametrize(
    "recipe, overrides",
    [
        ("grbm_bissm.toml", []),
        ("grbm_bidsm.toml", []),
        ("grbm_bidsm.toml", ['estimator.unroll="adam"']),
        ("grbm_ssm.toml", []),
        ("grbm_dsm.toml", []),
        ("grbm_ssm.toml", ['optim.model.kind="sgd"', "optim.model.momentum=0.9"]),
        ("grbm_bissm.toml", ['optim.model.schedule.kind="cosine"', 'optim.posterior.schedule.kind="cosine"']),
        ("grbm_bidsm.toml", ['estimator.unroll="adam"', 'optim.posterior.schedule.kind="cosine"']),
        ("grbm_dsm.toml", ['optim.model.schedule.kind="exponential"', "optim.model.schedule.gamma=0.99"]),
        ("grbm_vagesdsm.toml", []),
    ],
)
def test_the_score_matching_steps_of_the_checkerboard_recipes_may_be_captured(recipe, overrides):
    assert refusal(recipe, overrides) is None


VAGES = ['estimator.kind="vages"', "~estimator.unroll_steps", "estimator.n_samples=2", "estimator.langevin_steps=5"]
EBM = ['model.kind="resnet-ebm"', "~model.latent_dim", "~posterior", "~divergence", 'estimator.kind="exact-score"']
EBM += ["~estimator.inner_steps", "~estimator.unroll_steps", "~optim.posterior"]
DEEP = {  # the deep steps, on the digits recipes (the CIFAR-10 ones are the same estimators at another size)
    "BiMDSM (bism-unrolled, gaussian q, fisher, cosine rate)": ("digits_bimdsm.toml", []),
    "MDSM, exact score (resnet-ebm, cosine rate)": ("digits_bimdsm.toml", EBM),
    "BiDVL (rates decayed per epoch)": ("digits_bidvl.toml", []),
    "VaGES-MDSM (5 Langevin steps on h, cosine rate)": ("digits_bimdsm.toml", VAGES),
}


@pytest.mark.parametrize("case", list(DEEP))
def test_the_deep_steps_with_their_schedules_may_be_captured(case):
    recipe, overrides = DEEP[case]
    assert refusal(recipe, [*overrides, "~eval"]) is None
    assert refusal(recipe, [*overrides, "~eval"], precision="bf16") is None  # autocast's casts are captured too


@pytest.mark.parametrize(
    "recipe, overrides, where, expected",
    [
        ("grbm_bissm.toml", [], {"device": torch.device("cpu")}, "not a CUDA device"),
        ("grbm_bissm.toml", [], {"world": 2}, "several processes"),
        ("grbm_dsm.toml", [], {"precision": "fp16"}, "precision fp16 scales the loss with a GradScaler"),
        (
            "grbm_bism_implicit.toml",
            ["estimator.fixed_iterations=false"],
            {},
            "its conjugate-gradient and Neumann solves stop at a tolerance",
        ),
        (
            "grbm_ssm.toml",
            ['optim.model.kind="sgd"', "optim.model.momentum=0.9", 'optim.model.schedule.kind="cosine"'],
            {},
            "role 'model' follows a schedule and its SGD is not the fused one",
        ),
    ],
)
def test_a_step_that_cannot_be_captured_is_refused_with_the_reason(recipe, overrides, where, expected):
    assert expected in (refusal(recipe, overrides, **where) or "")


def test_an_unfused_adam_is_refused():
    seed_everything(0)
    built = build(load_recipe(RECIPES / "grbm_bissm.toml"), "cpu")
    assert optimizer_refusal(built.roles) is None
    built.roles["posterior"].optimizer.param_groups[0]["fused"] = False
    assert "Adam of role 'posterior' is not the fused one" in optimizer_refusal(built.roles)


def test_the_logged_gradient_norm_is_the_mean_since_the_last_log_kept_in_one_tensor():
    p = torch.zeros(3, requires_grad=True)
    role = TrainingRole("model", torch.optim.SGD([p], lr=0.1))
    role.update((torch.tensor([3.0, 4.0, 0.0]) * p).sum())  # gradient norm 5
    role.update((torch.tensor([0.0, 0.0, 1.0]) * p).sum())  # gradient norm 1
    stats = role._norms[0]
    assert role.take_mean_grad_norm() == pytest.approx(3.0)
    assert role.take_mean_grad_norm() is None
    role.update((torch.tensor([0.0, 2.0, 0.0]) * p).sum())
    assert role.take_mean_grad_norm() == pytest.approx(2.0)
    assert role._norms[0] is stats  # reset in place: a captured step keeps adding to it


# ---- the loop around the step: metric sums, the NaN guard's sentinel, the batch drawn ahead -------


def test_step_sums_add_in_place_as_the_loop_did_and_read_once():
    from collections import defaultdict

    from eblvm_core.state import StepSums

    steps = [
        {"loss": torch.tensor(1.25), "lower_loss": torch.tensor(-0.5, dtype=torch.float64), "iterations": 3.0},
        {"loss": torch.tensor(0.1), "lower_loss": torch.tensor(1e-3, dtype=torch.float64), "iterations": 4.0},
        {"loss": torch.tensor(2.0 / 3.0), "extra": torch.tensor(7.0), "lower_loss": torch.tensor(0.3)},
    ]
    sums, before = StepSums(), defaultdict(float)
    for metrics in steps:
        sums.add(metrics)
        for k, v in metrics.items():  # the loop's former arithmetic: float32 sums, new tensors each step
            before[k] = before[k] + (v.detach().float() if isinstance(v, torch.Tensor) else float(v))
    accumulators = dict(sums.tensors)
    assert sums.loss_finite()
    taken = sums.take()
    assert list(taken) == ["loss", "lower_loss", "iterations", "extra"]  # the order the metrics came in
    assert taken == {k: float(v) for k, v in before.items()}
    sums.add({"loss": torch.tensor(5.0)})
    assert sums.take() == {"loss": 5.0}  # metrics missing since the last take are not reported
    assert all(sums.tensors[k] is accumulators[k] for k in accumulators)  # zeroed in place, never replaced


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_the_sentinel_turns_at_a_non_finite_loss_and_not_at_a_huge_one(bad):
    from eblvm_core.state import StepSums

    sums = StepSums()
    for _ in range(3):
        sums.add({"loss": torch.tensor(3e38)})  # finite; their float32 sum overflows
    assert sums.loss_finite() and sums.take()["loss"] == float("inf")
    sums.add({"loss": torch.tensor(1.0)})
    sums.add({"loss": torch.tensor(bad)})
    sums.add({"loss": torch.tensor(1.0)})
    assert not sums.loss_finite()
    sums.take()
    sums.add({"loss": torch.tensor(1.0)})
    assert sums.loss_finite()
    sums.add({"loss": bad})  # a number: noted on the host
    assert not sums.loss_finite()


def test_a_non_finite_tensor_loss_stops_the_run_at_the_next_check(tmp_path, monkeypatch):
    """A loss tensor that turns NaN at step 13 (the parameters stay finite) stops the run at the
    next check, the checkpoint step 15 (before anything is written), naming the last log step
    before it, as the loop's former per-step check did."""
    from eblvm_core.errors import TrainingDiverged
    from tests.support import session_run as run

    def nan_loss(built, metrics) -> None:
        metrics["loss"] = metrics["loss"] * float("nan")

    poison_at(monkeypatch, 13, nan_loss)
    options = ["run.steps=40", "run.log_every=10", "run.checkpoint_every=15", "run.eval_every=0"]
    with pytest.raises(
        TrainingDiverged, match="step 15: training loss became non-finite after step 10; run stopped, no checkpoint"
    ):
        run(RECIPES / "grbm_dsm.toml", options, out=tmp_path, echo=lambda _: None)


def test_a_batch_drawn_ahead_is_the_batch_next_returns_and_the_position_stays_the_used_ones():
    """Batches.prefetch (the loop on CUDA calls it after launching each step) draws the batch that
    next() returns next; state_dict, which checkpoints keep, counts only the batches returned, so
    a run resumed from it draws the prefetched batch again."""
    from eblvm_core.contracts import DataSplits
    from eblvm_core.data import Batches

    data = DataSplits(train=torch.arange(50.0).view(25, 2), test=torch.zeros(2, 2))
    plain = Batches(data, 10, 3, torch.device("cpu"), torch.float32)
    ahead = Batches(data, 10, 3, torch.device("cpu"), torch.float32)
    for _ in range(7):  # three epochs of two batches, and one more: across epoch boundaries
        assert torch.equal(ahead.next(), plain.next())
        ahead.prefetch()
        ahead.prefetch()  # a second call draws nothing more
        assert ahead.state_dict() == plain.state_dict()
    resumed = Batches(data, 10, 3, torch.device("cpu"), torch.float32)
    resumed.load_state_dict(ahead.state_dict())
    ahead.load_state_dict(ahead.state_dict())  # drops the batch drawn ahead
    expected = plain.next()
    assert torch.equal(resumed.next(), expected) and torch.equal(ahead.next(), expected)
