"""Checkpoints kept every [run] keep_every steps and evaluated with ``eval --checkpoint step:N``:
the training's schedule and the eval command agree, to the last digit printed. (Early stopping is
tested in tests/core/test_trainer.py, a run's name folder in tests/core/test_rundir.py.)"""

from __future__ import annotations

from eblvm_core import checkpoint as ckpt
from tests.support import SMALL_RECIPE, metrics_rows, networks, only_run_dir, same_tensors, scalars

KEEP = SMALL_RECIPE.replace("steps = 30", "steps = 40").replace(
    "checkpoint_every = 10", "checkpoint_every = 30\neval_every = 20\nkeep_every = 20"
)


# ---- kept checkpoints ------------------------------------------------------------------------


def test_kept_checkpoints_hold_their_step_and_evaluate_as_training_did(cli, write_recipe, tmp_path):
    """keep_every = 20 with checkpoint_every = 30: step-20.pt and step-40.pt (a schedule of their
    own), sealed like last.pt; step-20.pt holds the parameters of a run stopped at 20, and
    `eval --checkpoint step:20` gives exactly the evaluation the training wrote at step 20."""
    out = tmp_path / "runs"
    assert cli(["run", write_recipe(KEEP), "--out", out]).exit_code == 0
    run_dir = only_run_dir(out)
    assert ckpt.kept_steps(run_dir) == [20, 40]
    kept = ckpt.read_checkpoint(ckpt.kept_checkpoint(run_dir, 20))  # verifies the checksum
    assert kept["step"] == 20 and "checksum" in kept
    assert ckpt.read_checkpoint(ckpt.last_checkpoint(run_dir))["step"] == 40

    short = tmp_path / "short"
    assert cli(["run", write_recipe(KEEP), "--out", short, "-o", "run.steps=20"]).exit_code == 0
    assert same_tensors(
        networks(ckpt.kept_checkpoint(run_dir, 20)), networks(ckpt.last_checkpoint(only_run_dir(short)))
    )
    assert not same_tensors(networks(ckpt.kept_checkpoint(run_dir, 20)), networks(ckpt.last_checkpoint(run_dir)))

    result = cli(["eval", run_dir, "--checkpoint", "step:20"])
    assert result.exit_code == 0, result.output
    trained = next(r for r in metrics_rows(run_dir) if r["step"] == 20 and "eval/exact-loglik/test_loglik" in r)
    appended = metrics_rows(run_dir)[-1]
    assert appended["checkpoint"] == "step:20" and appended["step"] == 20
    assert appended["eval/exact-loglik/test_loglik"] == trained["eval/exact-loglik/test_loglik"]
    printed = scalars(result.output)["exact-loglik/test_loglik"]
    assert f"{printed:.6g}" == f"{trained['eval/exact-loglik/test_loglik']:.6g}"
    assert "step 20 (step:20)" in result.output
