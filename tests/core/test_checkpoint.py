"""checkpoint.py: atomic saves, weights-only loads, the checksum, tensors moved to a device whole,
and an older format (3) still resuming to the bit."""

from __future__ import annotations

import os
import shutil
import tomllib

import pytest
import tomli_w
import torch

import eblvm
from eblvm_core import checkpoint as ckpt
from eblvm_core.errors import CheckpointError
from tests.support import ROOT

# ---- saving and loading --------------------------------------------------------------------------


def test_atomic_save_leaves_old_file_on_failure(tmp_path):
    path = tmp_path / "c.pt"
    ckpt.save_atomic({"x": torch.ones(2)}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    try:
        ckpt.save_atomic({"x": Unpicklable()}, path)
    except RuntimeError:
        pass
    assert torch.equal(ckpt.load(path)["x"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"], "no temp file may be left behind"


def test_checkpoints_load_weights_only(tmp_path):
    import pickle

    path = tmp_path / "evil.pt"

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"x": Evil()}, path, pickle_module=pickle)
    try:
        ckpt.load(path)
    except pickle.UnpicklingError:
        return
    raise AssertionError("a checkpoint with arbitrary objects must not load")


def test_a_checkpoint_moves_to_a_device_whole():
    state = {"a": torch.ones(2), "b": [torch.zeros(1), (torch.ones(1), 3)], "c": "x"}
    moved = ckpt.to_device(state, torch.device("meta"))
    assert moved["a"].is_meta and moved["b"][0].is_meta and moved["b"][1][0].is_meta
    assert isinstance(moved["b"][1], tuple) and moved["b"][1][1] == 3 and moved["c"] == "x"


def test_the_checksum_covers_every_tensor_byte_and_plain_value():
    state = {"format": 3, "step": 5, "networks": {"m": {"w": torch.arange(6.0).view(2, 3)}}, "best": None}
    digest = ckpt.checksum(state)
    assert ckpt.checksum(ckpt.seal(state)) == digest, "the checksum leaves itself out"
    changed = [
        {**state, "step": 6},
        {**state, "best": 0.0},
        {**state, "networks": {"m": {"w": torch.arange(6.0).view(3, 2)}}},  # same bytes, another shape
        {**state, "networks": {"m": {"w": torch.arange(6.0, dtype=torch.float64).view(2, 3)}}},
        {**state, "networks": {"m": {"w": torch.arange(6.0).view(2, 3).nextafter(torch.tensor(9.0))}}},
    ]
    assert all(ckpt.checksum(other) != digest for other in changed)


# ---- older formats -------------------------------------------------------------------------------

OLD_RUN = ROOT / "tests" / "support" / "format3_run"


def test_a_format_3_checkpoint_resumes_to_the_uninterrupted_run(tmp_path):
    old = ckpt.load(OLD_RUN / "checkpoints" / "last.pt")
    assert old["format"] == 3 and old["step"] == 20 and set(old["ema"]) == {"posterior"}
    run_dir = tmp_path / "old"
    shutil.copytree(OLD_RUN, run_dir)
    # The old run's 20 steps were taken where they were written; here a fresh run of its recipe ends
    # 3e-8 away in W (the previous release here too), so both runs stay eager and agree to float32
    # rounding. Not restoring the optimizer's state moves W by 2e-2.
    resumed = eblvm.train(resume=run_dir, overrides={"run.steps": 40, "run.compile": False}, echo=None)

    recipe = tomllib.loads((OLD_RUN / "recipe.toml").read_text())
    recipe["run"]["steps"] = 40
    recipe["run"]["compile"] = False
    (tmp_path / "r.toml").write_text(tomli_w.dumps(recipe))
    fresh = eblvm.train(tmp_path / "r.toml", out=tmp_path / "runs", echo=None)

    a = ckpt.load(resumed.run_dir / "checkpoints" / "last.pt")
    b = ckpt.load(fresh.run_dir / "checkpoints" / "last.pt")
    assert a["step"] == b["step"] == 40
    for section, tensors in b["networks"].items():
        for key, value in tensors.items():
            torch.testing.assert_close(a["networks"][section][key], value, rtol=1e-5, atol=1e-6)
    assert resumed.metrics.keys() == fresh.metrics.keys()
    assert resumed.metrics == pytest.approx(fresh.metrics, rel=1e-5)


# ---- read_checkpoint: what it refuses ------------------------------------------------------------


def sealed(tmp_path, **extra):
    """A small sealed checkpoint of format 4 written to tmp_path/c.pt: (path, its weight tensor)."""
    weight = torch.arange(16, dtype=torch.float32) / 7
    state = {"format": ckpt.CHECKPOINT_FORMAT, "step": 3, "networks": {"m": {"w": weight}}, "best": None, **extra}
    path = tmp_path / "c.pt"
    ckpt.save_atomic(ckpt.seal(state), path)
    return path, weight


def test_read_checkpoint_refuses_a_flipped_bit_of_a_tensor(tmp_path):
    from tests.support import flip_a_bit_of

    path, weight = sealed(tmp_path)
    assert torch.equal(ckpt.read_checkpoint(path)["networks"]["m"]["w"], weight)
    flip_a_bit_of(path, weight)
    assert not torch.equal(ckpt.load(path)["networks"]["m"]["w"], weight), "the flip must reach the tensor"
    with pytest.raises(CheckpointError, match="checksum mismatch: the file was changed or damaged"):
        ckpt.read_checkpoint(path)


def test_read_checkpoint_refuses_a_changed_plain_value(tmp_path):
    path, _ = sealed(tmp_path)
    state = ckpt.load(path)
    state["step"] = 4  # the checksum of step 3 kept
    torch.save(state, path)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        ckpt.read_checkpoint(path)


@pytest.mark.parametrize(
    "make, said",
    [
        (lambda path: None, "no such checkpoint file"),
        (lambda path: path.mkdir(), "not a file"),
        (lambda path: path.write_bytes(b""), "empty file (0 bytes)"),
        (lambda path: torch.save([1, 2], path), "not an eblvm checkpoint: it holds a bare list"),
        (lambda path: torch.save({"format": 99, "step": 0}, path), "checkpoint format 99 is not one of (2, 3, 4)"),
        (lambda path: torch.save({"format": 4, "step": 0}, path), "no checksum: the file is incomplete"),
        (lambda path: torch.save({"format": 3, "step": 0}, path), "no checksum"),
    ],
)
def test_read_checkpoint_says_what_is_wrong_naming_the_file(tmp_path, make, said):
    path = tmp_path / "c.pt"
    make(path)
    with pytest.raises(CheckpointError) as refused:
        ckpt.read_checkpoint(path)
    assert str(refused.value).startswith(f"{path}: ") and said in str(refused.value), str(refused.value)


def test_format_2_has_no_checksum_and_formats_2_and_3_come_by_role(tmp_path):
    """Format 2 and 3 kept each role's optimizer, gradient scaler and average side by side; they are
    read in the layout of today's format (one state per role)."""
    old = {
        "format": 2,
        "step": 5,
        "optimizers": {"model": {"state": {}}, "posterior": {"state": {1: 2}}},
        "scalers": {"model": {"scale": 1.0}},
        "ema": {"posterior": [torch.ones(2)]},
    }
    path = tmp_path / "old.pt"
    torch.save(old, path)
    state = ckpt.read_checkpoint(path)
    assert "optimizers" not in state and "scalers" not in state and "ema" not in state
    assert state["roles"]["model"] == {"optimizer": {"state": {}}, "scaler": {"scale": 1.0}}
    assert set(state["roles"]["posterior"]) == {"optimizer", "ema"}
    assert torch.equal(state["roles"]["posterior"]["ema"][0], torch.ones(2))
    today = {"format": 4, "roles": {"model": {"optimizer": {}}}}
    assert ckpt.by_role(today) is today


# ---- the recipe a checkpoint belongs to -----------------------------------------------------------


def test_a_checkpoint_belongs_to_its_recipe_up_to_options_it_predates():
    from eblvm_core.recipe import training_part
    from tests.support import SMALL_RECIPE

    recipe = eblvm.load_recipe(tomllib.loads(SMALL_RECIPE))
    ours = training_part(recipe.to_dict())
    ckpt.check_checkpoint_recipe({"recipe": ours}, recipe, "c.pt")
    ckpt.check_checkpoint_recipe({}, recipe, "c.pt")  # format 2: no recipe kept
    other = tomllib.loads(tomli_w.dumps(ours))
    other["objective"]["sigma"] = 0.2
    with pytest.raises(
        CheckpointError, match=r"^c.pt: written by another recipe: objective.sigma is 0.2 there and 0.1 in"
    ):
        ckpt.check_checkpoint_recipe({"recipe": other}, recipe, "c.pt")
    before_beta1 = tomllib.loads(tomli_w.dumps(ours))
    del before_beta1["optim"]["model"]["beta1"]  # at its default here: the checkpoint predates the option
    ckpt.check_checkpoint_recipe({"recipe": before_beta1}, recipe, "c.pt")
    before_lr = tomllib.loads(tomli_w.dumps(ours))
    del before_lr["optim"]["model"]["lr"]  # 1e-2 here, not the default
    with pytest.raises(CheckpointError, match=r"optim.model.lr is None there and 0.01"):
        ckpt.check_checkpoint_recipe({"recipe": before_lr}, recipe, "c.pt")


# ---- RNG, kept checkpoints, temporaries ----------------------------------------------------------


def test_the_rng_state_puts_back_every_stream():
    import random

    import numpy as np

    saved = ckpt.rng_state()
    first = (torch.rand(3), random.random(), np.random.rand(2))
    ckpt.set_rng_state(saved)
    again = (torch.rand(3), random.random(), np.random.rand(2))
    assert torch.equal(first[0], again[0]) and first[1] == again[1] and (first[2] == again[2]).all()


@pytest.mark.parametrize("seed", [0, 7, 2**32 + 5])
def test_seed_everything_starts_the_streams_torch_manual_seed_and_the_seeded_generators_start(seed):
    """On a machine without an accelerator it seeds torch's CPU generator alone, as torch.manual_seed
    does there; Python's and NumPy's generators (the latter modulo 2**32) as their own seed functions."""
    import random

    import numpy as np

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    want = (torch.rand(3), torch.randn(2, dtype=torch.float64), random.random(), np.random.rand(2))
    torch.manual_seed(seed + 1)  # other states, so a generator left unseeded shows
    random.seed(seed + 1)
    np.random.seed((seed + 1) % 2**32)
    ckpt.seed_everything(seed)
    got = (torch.rand(3), torch.randn(2, dtype=torch.float64), random.random(), np.random.rand(2))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2] == want[2] and (got[3] == want[3]).all()


def test_kept_steps_are_in_numeric_order_and_stale_temporaries_alone_are_removed(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for name in (
        "step-100.pt",
        "step-20.pt",
        "step-3.pt",
        "step-x.pt",
        "last.pt",
        ".last.pt.ab12.tmp",
        ".step-20.pt.q.tmp",
    ):
        (folder / name).write_bytes(b"x")
    assert ckpt.kept_steps(tmp_path) == [3, 20, 100]
    assert ckpt.kept_steps(tmp_path / "nowhere") == []
    removed = ckpt.remove_stale_temporaries(tmp_path)
    assert sorted(p.name for p in removed) == [".last.pt.ab12.tmp", ".step-20.pt.q.tmp"]
    assert sorted(p.name for p in folder.iterdir()) == [
        "last.pt",
        "step-100.pt",
        "step-20.pt",
        "step-3.pt",
        "step-x.pt",
    ]
