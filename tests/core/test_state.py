"""state.py: ``RunState``, what a checkpoint holds of a run. Saved and restored, a state trains on
to the bit as if it had never stopped (networks, every role's optimizer and average, the data
stream's position, the RNG); restored for evaluation it takes the networks and the averages
alone; a checkpoint that does not fit is an error naming it; kept and best checkpoints."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eblvm_core import checkpoint as ckpt
from eblvm_core import plugins
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
    assert_same_snapshot(everything(a), everything(b))


def snapshot(state) -> tuple[dict[str, torch.Tensor], dict]:
    """``everything`` of a state, copied: what it holds now, the process's RNG streams included."""
    import copy

    tensors, plain = everything(state)
    return {k: v.clone() for k, v in tensors.items()}, copy.deepcopy(plain)


def equal(x, y) -> bool:
    """Equal to the bit, tensors (dtype included) inside dicts and lists too."""
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return type(x) is type(y) and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(equal(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(equal(u, v) for u, v in zip(x, y))
    return x == y


def assert_same_snapshot(a, b) -> None:
    (ta, pa), (tb, pb) = a, b
    assert pa.keys() == pb.keys() and ta.keys() == tb.keys()
    for key in pa:
        assert equal(pa[key], pb[key]), (key, pa[key], pb[key])
    for key in ta:
        assert equal(ta[key], tb[key]), key


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


# ---- properties (hypothesis) ---------------------------------------------------------------------

# Every bundled estimator on a small recipe (the contract tests' sizes): a GRBM with a Bernoulli q
# on a small checkerboard, BiDVL's three networks on digits.
ESTIMATOR_BASE = """
[run]
seed = 0
batch_size = 16

[data]
kind = "checkerboard"
n_train = 256
n_test = 64

[model]
kind = "grbm"
n_hidden = 3

[posterior]
kind = "bernoulli"

[objective]
kind = "dsm"

[divergence]
kind = "kl"
"""
BIDVL_BASE = """
[run]
seed = 0
batch_size = 8

[data]
kind = "digits"
scale = "symmetric"

[model]
kind = "bidvl-energy"
base = 4

[posterior]
kind = "gaussian-dcgan"
base = 4
latent_dim = 3

[generator]
kind = "bidvl-generator"
base = 4
latent_dim = 3
"""
SMALL_OPTIONS = {
    "bism-unrolled": {"inner_steps": 1, "unroll_steps": 1},
    "bism-implicit": {"inner_steps": 1, "solver_steps": 2},
    "pcd": {"n_chains": 16},
    "nce": {"init_samples": 200},
    "vnce": {"init_samples": 200, "inner_steps": 1, "n_importance": 4},
    "vaes": {"inner_steps": 1},
    "vages": {"inner_steps": 1},
}


@functools.cache
def estimator_recipe(name: str) -> dict:
    """The small recipe of estimator ``name`` with an [optim.<role>] per role it trains."""
    import tomllib

    from eblvm.testing.checks import _build_with_roles

    raw = tomllib.loads(BIDVL_BASE if name == "bidvl" else ESTIMATOR_BASE)
    raw["estimator"] = {"kind": name, **SMALL_OPTIONS.get(name, {})}
    raw["log"] = []
    _build_with_roles(raw, f"<{name}>")
    return raw


@pytest.mark.property
@pytest.mark.parametrize(
    "name",  # BiDVL builds an encoder and a generator: 1.5 s, slow
    [pytest.param(n, marks=pytest.mark.slow) if n == "bidvl" else n for n in plugins.load()["estimators"].names()],
)
@settings(max_examples=4)
@given(saved_at=st.integers(1, 3), other_at=st.integers(0, 3), averaged=st.booleans(), seed=st.integers(0, 2**32))
def test_save_then_load_gives_the_same_state_for_every_estimator_at_any_step(name, saved_at, other_at, averaged, seed):
    """Every bundled estimator, saved after any number of steps (a parameter average on each role
    or none): another state built alike and moved elsewhere (other steps, draws from every RNG),
    loaded from that checkpoint, holds the same state to the bit (networks, every role's optimizer
    and average, the estimator's own state such as persistent chains, the data's position, the
    RNG streams), and the two take the same next step."""
    import copy
    import random
    import tempfile

    import numpy as np

    from tests.support import small_state_of

    raw = copy.deepcopy(estimator_recipe(name))
    raw["run"]["seed"] = seed
    for role in raw["optim"].values():
        role["ema"] = 0.9 if averaged else None
        if not averaged:
            del role["ema"]
    recipe, a = small_state_of(copy.deepcopy(raw))
    steps(a, recipe, saved_at)
    with tempfile.TemporaryDirectory() as tmp:
        a.save(Path(tmp))
        path = ckpt.last_checkpoint(Path(tmp))
        saved = snapshot(a)
        steps(a, recipe, 1)
        after = snapshot(a)  # the RNG streams are the process's: A's next step is taken before B exists
        recipe, b = small_state_of(copy.deepcopy(raw))
        steps(b, recipe, other_at)
        torch.rand(3), random.random(), np.random.rand(2)
        b.restore(ckpt.read_checkpoint(path), source=path)
    assert b.step == saved_at
    assert_same_snapshot(saved, snapshot(b))
    steps(b, recipe, 1)
    assert_same_snapshot(after, snapshot(b))
