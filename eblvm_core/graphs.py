"""Training steps captured once in a CUDA graph and replayed (``GraphedStep``): WARMUP_STEPS eager
calls on a side stream, a capture on a static batch, then copy-and-replay; random numbers and
scheduled rates (``optim.RateTensors``) advance as the eager step's would. The plan decides
(``plan.graph_verdict``); CONTRIBUTING.md ("How a step is compiled or captured") has the design."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from eblvm_core.optim import RateTensors
from eblvm_core.roles import TrainingRole

WARMUP_STEPS = 3
Step = Callable[[Tensor], dict[str, Tensor]]


def optimizer_refusal(roles: Mapping[str, TrainingRole]) -> str | None:
    """Why the roles' optimizers cannot be captured, or None. The plan admits the bundled Adam and
    SGD by kind (``plan.graph_verdict``); these are the instances: a scheduled rate is read from a
    device tensor (``RateTensors``), which the fused Adam and SGD kernels take; torch's other SGD
    kernels read a tensor rate on the host, so a scheduled SGD must be the fused one."""
    for name, role in roles.items():
        optimizer = role.optimizer
        fused = all(group.get("fused") for group in optimizer.param_groups)
        if isinstance(optimizer, torch.optim.Adam):
            if not fused:
                return f"the Adam of role '{name}' is not the fused one"
        elif isinstance(optimizer, torch.optim.SGD):
            if role.scheduled and not fused:
                return (
                    f"the learning rate of role '{name}' follows a schedule and its SGD is not the fused one "
                    "(torch's other SGD kernels read a rate tensor on the host)"
                )
        else:
            return f"the optimizer of role '{name}' ({type(optimizer).__name__}) is not known to be capturable"
    return None


def scheduled_rates(roles: Mapping[str, TrainingRole]) -> RateTensors | None:
    """Rate tensors for the roles whose learning rate follows a schedule, or None when none does."""
    scheduled = [role.optimizer for role in roles.values() if role.scheduled]
    return RateTensors(scheduled) if scheduled else None


class GraphedStep:
    """``step(batch) -> metrics`` replayed from a CUDA graph after WARMUP_STEPS eager calls.

    Every call is one real training step, the same as the eager one. When the step turns out not
    to be capturable (metrics that are not tensors, a batch of another shape, an error during
    capture) ``refusal`` says why, ``report`` is told once, and the calls stay eager. ``rates``
    holds the scheduled learning rates: before every call each group's current rate is written into
    its tensor (outside the replay, in place), and the eager and capturing calls run with the
    tensors in the groups, so that the graph reads the rate of the step it replays.
    """

    def __init__(
        self,
        step: Step,
        roles: Mapping[str, TrainingRole],
        report: Callable[[str], None] = print,
        rates: RateTensors | None = None,
    ):
        self.step, self.roles, self.report, self.rates = step, roles, report, rates
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_batch: Tensor | None = None
        self.static_metrics: dict[str, Tensor] = {}
        self.refusal: str | None = None
        refusal = optimizer_refusal(roles)
        if refusal is not None:
            self.refuse(refusal)

    def __call__(self, batch: Tensor) -> dict[str, Tensor]:
        if self.refusal is not None:
            return self.step(batch)
        if self.rates is not None:
            self.rates.write()
        static = self.static_batch
        if self.graph is not None and static is not None:
            if batch.shape != static.shape or batch.dtype != static.dtype:
                self.refuse(f"a batch of shape {tuple(batch.shape)} came after {tuple(static.shape)}")
                self.graph = None
                return self.step(batch)
            static.copy_(batch)
            self.graph.replay()
            return self.static_metrics
        self.calls += 1
        with self.rates.installed() if self.rates is not None else contextlib.nullcontext():
            if self.calls <= WARMUP_STEPS:
                return self._warm_up(batch)
            return self._capture(batch)

    def refuse(self, why: str) -> None:
        self.refusal = why
        self.report(f"CUDA graph: training eagerly from here on: {why}")

    def _warm_up(self, batch: Tensor) -> dict[str, Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            metrics = self.step(batch)
        torch.cuda.current_stream().wait_stream(side)
        loose = sorted(k for k, v in metrics.items() if not isinstance(v, Tensor))
        if loose:
            self.refuse(f"the step returns {', '.join(loose)} as Python numbers (read from the device each step)")
        return metrics

    def _capture(self, batch: Tensor) -> dict[str, Tensor]:
        """Capture the step on a static copy of ``batch``, then replay it once for this batch."""
        adams = [role.optimizer for role in self.roles.values() if isinstance(role.optimizer, torch.optim.Adam)]
        saved = [[group["capturable"] for group in opt.param_groups] for opt in adams]
        self.static_batch = batch.clone()
        graph = torch.cuda.CUDAGraph()
        try:
            for opt in adams:  # the fused kernel ignores the flag; step() checks it while capturing
                for group in opt.param_groups:
                    group["capturable"] = True
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                self.static_metrics = self.step(self.static_batch)
        except RuntimeError as exc:
            self.refuse(f"capture failed ({' '.join(str(exc).split())[:160]})")
            self.static_batch, self.static_metrics = None, {}
            torch.cuda.synchronize()
            return self.step(batch)
        finally:
            for opt, flags in zip(adams, saved):
                for group, flag in zip(opt.param_groups, flags):
                    group["capturable"] = flag
        self.graph = graph
        # torch (to 2.11 at least) writes the generator's graph seed and offset tensors on the capture
        # stream as capture begins, and again on this stream before each replay; nothing orders the
        # two writes, so wait for the first before the first replay writes and reads them.
        torch.cuda.synchronize()
        self.graph.replay()
        return self.static_metrics
