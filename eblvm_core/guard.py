"""The NaN guard of the training loop: what stops a run whose loss, parameters, buffers or
evaluations are no longer finite, and the line that says which checkpoint holds the last good
parameters."""

from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch import Tensor

from eblvm_core import distributed
from eblvm_core.errors import TrainingDiverged
from eblvm_core.state import RunState, StepSums

NON_FINITE = re.compile(r"\bnan\b|\binf\b|p_in|finite", re.IGNORECASE)  # what a step fails with on NaN/Inf


class Guard:
    """The NaN guard: a non-finite loss, trained parameter, network buffer or evaluation stops the
    run (``TrainingDiverged``, exit 3) saying which checkpoint holds the last good parameters."""

    def __init__(self, state: RunState):
        self.state = state

    def diverged(self, what: str, step: int | None = None) -> TrainingDiverged:
        """The error for a divergence at ``step`` (default: the last one taken)."""
        last_saved, now = self.state.last_saved, self.state.step
        if last_saved is None:
            kept = "no checkpoint was written before it"
        elif last_saved[0] == now:
            kept = f"the checkpoint {last_saved[1]} holds this step's parameters"
        else:
            kept = f"last good checkpoint: {last_saved[1]} (step {last_saved[0]}; {self.evaluated(last_saved[0])})"
        return TrainingDiverged(f"step {now if step is None else step}: {what}; run stopped, {kept}")

    def evaluated(self, step: int) -> str:
        """Whether the checkpoint at ``step`` was evaluated: its parameters are finite (the guard
        checked them) but only an evaluation says the model has not degenerated."""
        last = self.state.evaluated_step
        if last == step:
            return "its evaluation was finite"
        if last is None:
            return "never evaluated"
        return f"not evaluated: the last evaluation, finite, was at step {last}"

    def nonfinite_parameter(self) -> str | None:
        """The name of a NaN or infinite trained parameter (any role) or network buffer, else None."""
        for name, role in self.state.roles.items():
            params = role.params
            finite = (
                torch.stack([torch.isfinite(p).all() for p in params]) if params else torch.ones(0, dtype=torch.bool)
            )
            if not bool(finite.all()):
                return f"parameter {self.state.param_names[name][int((~finite).nonzero()[0])]} (role '{name}')"
        for section, net in self.state.parts.networks().items():
            for key, buffer in net.named_buffers():
                if buffer.is_floating_point() and not bool(torch.isfinite(buffer).all()):
                    return f"buffer {section}.{key}"
        return None

    def check(self, sums: StepSums, since: int) -> None:
        """Stop on a non-finite loss since step ``since`` (the last check), or a non-finite
        parameter; on every rank (a collective under torchrun)."""
        if distributed.any_rank(not sums.loss_finite()):
            raise self.diverged(f"training loss became non-finite after step {since}")
        bad = self.nonfinite_parameter()
        if bad is not None:
            raise self.diverged(f"{bad} is not finite")

    def check_number(self, loss: Any) -> None:
        """A loss given as a number is checked at once (one process; several ranks agree at ``check``)."""
        if not isinstance(loss, Tensor) and not math.isfinite(loss) and self.state.world == 1:
            raise self.diverged(f"training loss is {loss}")

    def check_evaluation(self, scalars: dict[str, float]) -> None:
        bad = {k: v for k, v in scalars.items() if not math.isfinite(v)}
        if bad:
            key, value = next(iter(bad.items()))
            raise self.diverged(f"evaluation gave {key} = {value}: the model has degenerated")

    def step_failed(self, exc: Exception) -> TrainingDiverged | None:
        """A step that raised on non-finite values (a NaN probability in a sampler) or with a
        non-finite parameter is a divergence; anything else is a bug (None: re-raise it)."""
        bad = self.nonfinite_parameter()
        message = " ".join(str(exc).split()).split(" (Could this error message be improved?")[0]
        if bad is None and not NON_FINITE.search(message):
            return None
        cause = f"{bad} is not finite" if bad else "a value became non-finite"
        return self.diverged(f"the step failed: {cause} ({type(exc).__name__}: {message[:200]})", self.state.step + 1)
