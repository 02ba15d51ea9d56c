"""state.py: ``RunState``, what a checkpoint holds of a run. Saved and restored, a state trains on
to the bit as if it had never stopped (networks, every role's optimizer and average, the data
stream's position, the RNG); restored for evaluation it takes the networks and the averages
alone; a checkpoint that does not fit is an error naming it; kept and best checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eblvm_core import checkpoint as ckpt
from eblvm_core.errors import CheckpointError
from eblvm_core.trainer import Trainer
from tests.support import BISM, small_state, trained_tensors

# BiSM: two roles, the posterior's with a parameter average, the data drawn in shuffled batches
TWO_ROLES = BISM.replace('[optim.posterior]\nkind = "adam"', '[optim.posterior]\nkind = "adam"\nema = 0.9')


def steps(state, recipe, n: int) -> None:
    trainer = Trainer(recipe, state)
    for _ in range(n):
        trainer.step()


def everything(state) -> tuple[dict[str, torch.Tensor], dict]:
    """A state's checkpoint as (every tensor by path, every other value by key), the recipe left out."""
    saved = state.state()
    plain = {k: v for k, v in saved.items() if k not in ("networks", "roles", "estimator", "data", "rng", "recipe")}
    tensors = trained_tensors({k: saved[k] for k in ("networks", "roles", "estimator", "data", "rng")})
    return tensors, plain | {"python": saved["rng"]["python"], "numpy": saved["rng"]["numpy"][2:]}


def assert_same(a, b) -> None:
    (ta, pa), (tb, pb) = everything(a), everything(b)
    assert pa == pb
    assert ta.keys() == tb.keys()
    for key in ta:
        assert ta[key].dtype == tb[key].dtype and torch.equal(ta[key], tb[key]), key


def test_a_restored_state_trains_on_to_the_bit_as_the_saved_one(tmp_path):
    """A trains 4 steps, is saved, trains 3 more. B, built alike, is moved on (2 steps and some draws
    from every RNG), restored from the checkpoint and trains 3 steps: A and B are equal to the bit,
    networks, optimizers, the average, the data position and the RNG streams included."""
    import random

    import numpy as np

    recipe, a = small_state(TWO_ROLES)
    assert a.roles["posterior"].state_dict().get("ema") is not None, "the test needs a role with an average"
    steps(a, recipe, 4)
    a.save(tmp_path)
    path = ckpt.last_checkpoint(tmp_path)
    assert a.last_saved == (4, path)
    steps(a, recipe, 3)

    recipe, b = small_state(TWO_ROLES)
    steps(b, recipe, 2)
    torch.rand(5), random.random(), np.random.rand(3)
    b.restore(ckpt.read_checkpoint(path), source=path)
    assert b.step == 4 and b.last_saved == (4, path)
    steps(b, recipe, 3)
    assert_same(a, b)


def test_selection_state_is_checkpointed_with_the_rest(tmp_path):
    recipe, a = small_state()
    a.best, a.best_step, a.stale = 3.5, 20, 2
    a.save(tmp_path)
    recipe, b = small_state()
    b.restore(ckpt.read_checkpoint(ckpt.last_checkpoint(tmp_path)))
    assert (b.best, b.best_step, b.stale) == (3.5, 20, 2)


def test_restored_for_evaluation_it_takes_the_networks_and_averages_alone(tmp_path):
    recipe, a = small_state(TWO_ROLES)
    steps(a, recipe, 3)
    a.best = 1.0
    a.save(tmp_path)
    recipe, b = small_state(TWO_ROLES)
    optimizer_before = {k: v.clone() for k, v in trained_tensors(b.roles["model"].optimizer.state_dict()).items()}
    b.restore(ckpt.read_checkpoint(ckpt.last_checkpoint(tmp_path)), training=False)
    assert b.step == 3 and b.best is None and b.last_saved is None
    for section, net in a.parts.networks().items():
        theirs = b.parts.networks()[section].state_dict()
        assert all(torch.equal(v, theirs[k]) for k, v in net.state_dict().items()), section
    optimizer_after = trained_tensors(b.roles["model"].optimizer.state_dict())
    assert optimizer_after.keys() == optimizer_before.keys()
    assert all(torch.equal(optimizer_before[k], optimizer_after[k]) for k in optimizer_before)
    a_average = trained_tensors({"ema": a.roles["posterior"].state_dict()["ema"]})
    b_average = trained_tensors({"ema": b.roles["posterior"].state_dict()["ema"]})
    assert a_average.keys() == b_average.keys() and a_average
    assert all(torch.equal(a_average[k], b_average[k]) for k in a_average)


def test_a_checkpoint_that_does_not_fit_is_an_error_naming_it(tmp_path):
    recipe, state = small_state()
    saved = state.state()
    saved["networks"]["model"]["W"] = torch.zeros(3, 3)
    with pytest.raises(
        CheckpointError, match=r"^elsewhere/last.pt: does not fit this run's parts: .*size mismatch for W"
    ):
        state.restore(saved, source=Path("elsewhere/last.pt"))
    saved = state.state()
    del saved["roles"]
    with pytest.raises(CheckpointError, match=r"does not fit this run's parts: 'roles'"):
        state.restore(saved, source="c.pt")


def test_kept_last_and_best_checkpoints(tmp_path):
    recipe, state = small_state()
    steps(state, recipe, 2)
    state.save(tmp_path, last=False, keep=True)
    assert ckpt.kept_steps(tmp_path) == [2] and not ckpt.last_checkpoint(tmp_path).exists()
    assert state.last_saved is None, "a kept checkpoint alone is not what a resume starts from"
    steps(state, recipe, 1)
    state.save(tmp_path, keep=True)
    assert ckpt.kept_steps(tmp_path) == [2, 3] and state.last_saved == (3, ckpt.last_checkpoint(tmp_path))
    assert ckpt.read_checkpoint(ckpt.kept_checkpoint(tmp_path, 2))["step"] == 2
    last = ckpt.read_checkpoint(ckpt.last_checkpoint(tmp_path))
    kept = ckpt.read_checkpoint(ckpt.kept_checkpoint(tmp_path, 3))
    assert last["checksum"] == kept["checksum"]
    state.save_best(tmp_path)
    assert ckpt.read_checkpoint(ckpt.best_checkpoint(tmp_path))["step"] == 3


def test_out_of_patience_counts_evaluations_without_improvement():
    recipe, state = small_state(
        overrides=['run.select_metric="eval/exact-loglik/test_loglik"', "run.eval_every=5", "run.patience=2"]
    )
    assert not state.out_of_patience()
    state.stale = 1
    assert not state.out_of_patience()
    state.stale = 2
    assert state.out_of_patience()
    recipe, unbounded = small_state()
    unbounded.stale = 100
    assert not unbounded.out_of_patience()
