"""A run directory written by an earlier eblvm (checkpoint format 3: optimizers, gradient scalers
and parameter averages stored side by side, not by role) still resumes, and ends where a run of
today's code trained without a stop does, to the bit.

``tests/support/format3_run`` is BiSM on the small checkerboard (two roles: the model on a cosine
schedule, the posterior with an EMA; an evaluation every 10 steps selecting on the test
log-likelihood) stopped at step 20 of the 40 its schedule spans.
"""

from __future__ import annotations

import shutil
import tomllib

import tomli_w
import torch

import eblvm
from eblvm_core import checkpoint as ckpt
from tests.support import ROOT

OLD_RUN = ROOT / "tests" / "support" / "format3_run"


def test_a_format_3_checkpoint_resumes_to_the_uninterrupted_run(tmp_path):
    old = ckpt.load(OLD_RUN / "checkpoints" / "last.pt")
    assert old["format"] == 3 and old["step"] == 20 and set(old["ema"]) == {"posterior"}
    run_dir = tmp_path / "old"
    shutil.copytree(OLD_RUN, run_dir)
    resumed = eblvm.train(resume=run_dir, overrides={"run.steps": 40}, echo=None)

    recipe = tomllib.loads((OLD_RUN / "recipe.toml").read_text())
    recipe["run"]["steps"] = 40
    (tmp_path / "r.toml").write_text(tomli_w.dumps(recipe))
    fresh = eblvm.train(tmp_path / "r.toml", out=tmp_path / "runs", echo=None)

    a = ckpt.load(resumed.run_dir / "checkpoints" / "last.pt")
    b = ckpt.load(fresh.run_dir / "checkpoints" / "last.pt")
    assert a["step"] == b["step"] == 40
    for section, tensors in b["networks"].items():
        for key, value in tensors.items():
            assert torch.equal(a["networks"][section][key], value), f"{section}.{key}"
    assert resumed.metrics == fresh.metrics
