"""progress.py: the sums of the step metrics (``StepSums``), the log record and line (``Progress``:
means, speed, ETA) and the warning, once per role, when a role's gradient stays 0."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from eblvm_core.progress import Progress, duration
from eblvm_core.state import StepSums

# ---- a role that stops training ------------------------------------------------------------------


def test_a_role_whose_gradient_stays_zero_is_reported_once(write_recipe, tmp_path, monkeypatch):
    """A role whose mean gradient norm over a log interval is exactly 0 (e.g. BiDVL's energy behind a
    saturated softplus) is named once in the run log; a run whose gradients move says nothing."""
    from eblvm_core.roles import TrainingRole
    from tests.support import BISM
    from tests.support import session_run as run

    recipe = write_recipe(BISM)
    said: list[str] = []
    run(recipe, out=tmp_path / "alive", echo=said.append)
    assert not [line for line in said if "stopped training" in line]

    real = TrainingRole.take_mean_grad_norm
    monkeypatch.setattr(TrainingRole, "take_mean_grad_norm", lambda role: 0.0 * real(role))
    said.clear()
    run(recipe, out=tmp_path / "dead", echo=said.append)
    warned = [line for line in said if "stopped training" in line]
    assert len(warned) == 2 and "role 'model'" in warned[0] and "role 'posterior'" in warned[1], said


# ---- StepSums -----------------------------------------------------------------------------------


def test_step_sums_add_tensors_and_numbers_and_start_again_from_zero_in_place():
    sums = StepSums()
    sums.add({"loss": torch.tensor(1.0), "n": 2, "x": torch.tensor([3.0], dtype=torch.float64)})
    sums.add({"loss": torch.tensor(2.5), "n": 0.5, "x": torch.tensor([1.0], dtype=torch.float64)})
    accumulator = sums.tensors["loss"]
    assert accumulator.dtype == torch.float32 and accumulator.dim() == 0
    taken = sums.take()
    assert taken == {"loss": 3.5, "n": 2.5, "x": 4.0} and list(taken) == ["loss", "n", "x"]
    assert sums.tensors["loss"] is accumulator and float(accumulator) == 0.0, "the sums are zeroed in place"
    sums.add({"other": torch.tensor(1.0), "n": 1})  # another set of metrics
    sums.add({"other": torch.tensor(2.0), "n": 1})
    assert sums.take() == {"other": 3.0, "n": 2.0}, "only the metrics given since the last take"
    assert sums.take() == {}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_tensor_loss_turns_the_sentinel_until_the_next_take(bad):
    sums = StepSums()
    sums.add({"loss": torch.tensor(3.0e38)})  # finite, however large: 0·loss stays 0
    sums.add({"loss": torch.tensor(3.0e38)})  # the sum overflows, the sentinel does not
    assert sums.loss_finite()
    sums.add({"loss": torch.tensor(bad)})
    sums.add({"loss": torch.tensor(1.0)})  # a finite loss after it hides nothing
    assert not sums.loss_finite()
    sums.take()
    sums.add({"loss": torch.tensor(1.0)})
    assert sums.loss_finite(), "each log interval starts clean"


def test_a_non_finite_number_loss_is_seen_without_a_tensor():
    sums = StepSums()
    sums.add({"loss": 1.0})
    assert sums.loss_finite()
    sums.add({"loss": float("nan"), "other": torch.tensor(1.0)})
    assert not sums.loss_finite()
    sums.take()
    assert sums.loss_finite()


# ---- Progress -----------------------------------------------------------------------------------


class Written:
    """What Progress writes to (a Records' ``record`` and ``echo``), kept."""

    writes = False

    def __init__(self):
        self.rows, self.lines = [], []

    def record(self, step, scalars, images=None):
        self.rows.append((step, scalars))

    def echo(self, line):
        self.lines.append(line)


def test_the_log_holds_the_means_and_the_speed_without_pauses_and_the_eta_with_them(monkeypatch):
    """Four steps of 1 s each, then 6 s paused (an evaluation): 1 step/s, and an ETA of 15 s for the
    6 steps left (10 s for 4 so far, pauses included); the last log has no ETA."""
    import eblvm_core.progress as progress_module

    clock = [100.0]
    monkeypatch.setattr(progress_module, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    state, written = SimpleNamespace(step=0, roles={}, sums=StepSums()), Written()
    progress = Progress(state, written, total_steps=10)

    def steps(losses):
        for loss in losses:
            state.step += 1
            clock[0] += 1.0
            progress.add({"loss": torch.tensor(loss), "n": 2 * loss})

    steps([1.0, 2.0, 3.0, 4.0])
    with progress.pause():
        clock[0] += 6.0
    progress.log(last=False)
    assert written.rows == [(4, {"train/loss": 2.5, "train/n": 5.0, "speed/steps_per_s": 1.0})]
    assert written.lines == ["step 4/10  loss 2.5  (1.0 it/s, ETA 15s)"]
    clock[0] += 3.0  # between the log and the next step: counted in the speed, nothing paused
    steps([5.0, 7.0])
    progress.log(last=True)
    assert written.rows[-1] == (6, {"train/loss": 6.0, "train/n": 12.0, "speed/steps_per_s": 0.4})
    assert written.lines[-1] == "step 6/10  loss 6  (0.4 it/s)"


@pytest.mark.parametrize(
    "seconds, shown",
    [(0, "0s"), (42, "42s"), (59.4, "59s"), (59.6, "1m00s"), (185, "3m05s"), (3599, "59m59s"), (3600, "1h00m")],
)
def test_a_duration_is_shown_in_its_largest_units(seconds, shown):
    assert duration(seconds) == shown
    assert duration(7620) == "2h07m"
