"""Optimizers and learning-rate schedules (registered by the core itself), and learning rates in
device tensors for steps replayed from a CUDA graph. An optimizer config's ``max_grad_norm`` is
the clipping of the role it steps (``roles.TrainingRole``, made by the builder)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import Literal

import attrs
import torch
from torch import Tensor

from eblvm_core.config import in_range, non_negative, option, positive
from eblvm_core.contracts import Schedule
from eblvm_core.hookspecs import hookimpl


def _beta(_inst: object, _attr: object, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"must be in [0, 1), got {value}")


@attrs.frozen
class AdamConfig:
    lr: float = option(1e-3, "learning rate (the base rate of the role's schedule)", positive)
    beta1: float = option(0.9, "first-moment decay, in [0, 1)", _beta)
    beta2: float = option(0.999, "second-moment decay, in [0, 1)", _beta)
    eps: float = option(1e-8, "denominator offset", positive)
    weight_decay: float = option(0.0, "L2 penalty", non_negative)
    max_grad_norm: float | None = option(None, "clip the gradient norm to this value (> 0)", positive)


@attrs.frozen
class SGDConfig:
    lr: float = option(1e-2, "learning rate (the base rate of the role's schedule)", positive)
    momentum: float = option(0.0, "momentum", non_negative)
    weight_decay: float = option(0.0, "L2 penalty", non_negative)
    max_grad_norm: float | None = option(None, "clip the gradient norm to this value (> 0)", positive)


def adam(cfg: AdamConfig, params: Iterable[Tensor]) -> torch.optim.Optimizer:
    """Adam (Kingma & Ba); the fused kernel where every parameter is a CPU or CUDA float tensor."""
    params = list(params)
    fused = bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.Adam(
        params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay, fused=fused or None
    )


def sgd(cfg: SGDConfig, params: Iterable[Tensor]) -> torch.optim.Optimizer:
    """Stochastic gradient descent, optionally with momentum; the fused kernel where every parameter
    is a CUDA float tensor (it reads a rate tensor on the device, so a scheduled rate can be replayed
    from a CUDA graph; torch's other SGD kernels read a tensor rate on the host)."""
    params = list(params)
    fused = bool(params) and all(p.is_floating_point() and p.device.type == "cuda" for p in params)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, fused=fused or None)


# ---- learning rates in device tensors ------------------------------------------------------------


class RateTensors:
    """The learning rate of every param group of ``optimizers`` in a 0-d float32 tensor on the device
    of the group's parameters, for a training step captured in a CUDA graph.

    A graph replays the kernels it captured with the arguments they had: a rate given as a number
    would stay the rate of the capturing step. Captured while ``installed()`` puts the tensors in the
    groups' ``"lr"``, the optimizer kernels (fused Adam, fused SGD) and whatever else reads the rate
    inside the step (the differentiable Adam copy of the unrolled BiSM) read it from the tensor each
    replay instead. ``write()`` copies each group's current rate (the float the trainer's schedule
    set) into its tensor in place (``fill_``: no host synchronisation, and the memory the graph reads
    stays the same), before the replay and outside it, and only when it changed. Outside the step the groups
    hold floats again, so checkpoints, the ``lr/<role>`` log and the CPU fast path see numbers.
    """

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer]):
        self.optimizers = list(optimizers)
        self.slots: list[tuple[dict, Tensor]] = [
            (group, torch.zeros((), dtype=torch.float32, device=group["params"][0].device))
            for optimizer in self.optimizers
            for group in optimizer.param_groups
            if group["params"]
        ]
        self.written: list[float | None] = [None] * len(self.slots)

    def tensors(self) -> list[Tensor]:
        """The rate tensors, one a param group."""
        return [tensor for _, tensor in self.slots]

    def write(self) -> None:
        """Copy each group's rate into its tensor, in place, where it changed since the last write."""
        for i, (group, tensor) in enumerate(self.slots):
            lr = group["lr"]
            if lr is tensor:  # installed: the tensor already is the rate
                continue
            if isinstance(lr, Tensor):
                tensor.copy_(lr)
                self.written[i] = None
            elif lr != self.written[i]:
                tensor.fill_(lr)
                self.written[i] = lr

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Within the block every group's ``"lr"`` is its rate tensor; the previous values after it."""
        saved = [group["lr"] for group, _ in self.slots]
        for group, tensor in self.slots:
            group["lr"] = tensor
        try:
            yield
        finally:
            for (group, _), lr in zip(self.slots, saved):
                group["lr"] = lr


# ---- schedules ----------------------------------------------------------------------------------


class Constant(Schedule):
    """The base rate throughout."""

    constant = True

    def lr(self, base_lr: float, step: int, total_steps: int, steps_per_epoch: int) -> float:
        return base_lr


@attrs.frozen
class CosineConfig:
    warmup_steps: int = option(0, "steps of linear warm-up from base_lr/warmup_steps to the base rate", non_negative)
    min_lr: float = option(0.0, "the rate reached at the last step (the papers: 1e-6)", non_negative)
    total_steps: int | None = option(None, "steps the decay spans; None: the run's steps", positive)


@attrs.define
class Cosine(Schedule):
    """Linear warm-up, then half a cosine from the base rate down to ``min_lr``."""

    cfg: CosineConfig

    def lr(self, base_lr: float, step: int, total_steps: int, steps_per_epoch: int) -> float:
        warm, total = self.cfg.warmup_steps, self.cfg.total_steps or total_steps
        if step < warm:
            return base_lr * (step + 1) / warm
        t = min(1.0, (step - warm) / max(1, total - 1 - warm))
        return self.cfg.min_lr + (base_lr - self.cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))


@attrs.frozen
class ExponentialConfig:
    gamma: float = option(help="factor applied to the rate once per period, in (0, 1]", validator=in_range(1e-12, 1.0))
    every: Literal["step", "epoch"] = option(
        "epoch", "the period: one training step or one epoch of the training split"
    )


@attrs.define
class Exponential(Schedule):
    """base_lr · gammaᵏ after k whole periods (steps or epochs)."""

    cfg: ExponentialConfig

    def lr(self, base_lr: float, step: int, total_steps: int, steps_per_epoch: int) -> float:
        periods = step if self.cfg.every == "step" else step // max(1, steps_per_epoch)
        return base_lr * self.cfg.gamma**periods


def constant(cfg: object, parts: object) -> Constant:
    """Constant learning rate (the default)."""
    return Constant()


def cosine(cfg: CosineConfig, parts: object) -> Cosine:
    """Cosine decay to a floor after an optional linear warm-up."""
    return Cosine(cfg)


def exponential(cfg: ExponentialConfig, parts: object) -> Exponential:
    """Exponential decay per step or per epoch."""
    return Exponential(cfg)


@hookimpl
def register_optimizers(register):
    register("adam", adam, AdamConfig)
    register("sgd", sgd, SGDConfig)


@hookimpl
def register_schedules(register):
    from eblvm_core.registry import NoConfig

    register("constant", constant, NoConfig)
    register("cosine", cosine, CosineConfig)
    register("exponential", exponential, ExponentialConfig)
