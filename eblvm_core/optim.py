"""Optimizers and learning-rate schedules (registered by the core itself) and ``apply_update``,
the one helper every parameter update goes through."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

import attrs
import torch
from torch import Tensor

from eblvm_core import distributed
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
    opt = torch.optim.Adam(
        params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay, fused=fused or None
    )
    opt.max_grad_norm = cfg.max_grad_norm  # type: ignore[attr-defined]
    return opt


def sgd(cfg: SGDConfig, params: Iterable[Tensor]) -> torch.optim.Optimizer:
    """Stochastic gradient descent, optionally with momentum."""
    opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    opt.max_grad_norm = cfg.max_grad_norm  # type: ignore[attr-defined]
    return opt


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def apply_update(optimizer: torch.optim.Optimizer, loss: Tensor | None = None) -> Tensor:
    """Backward ``loss`` into the optimizer's parameters (if given), average over ranks, clip, and step.

    With ``loss`` the gradients of the optimizer's parameters are replaced (zeros where the
    loss does not reach); a caller that fills ``.grad`` itself passes ``loss=None``. With a
    process group (torchrun) the gradients are then averaged over the ranks (bucketed
    all-reduces), so every rank takes the same step: that of the mean of the ranks' losses;
    every rank must hand over the same parameters with gradients. Under fp16 (the optimizer
    carries a ``grad_scaler``) the loss is scaled, the gradients unscaled, and a step with
    non-finite gradients skipped. Returns the norm of the (averaged) gradient before clipping as
    a 0-d tensor (no host synchronisation) and adds it, in place, to the optimizer's running
    ``grad_norm_stats`` (sum, count) on the device, which the trainer logs as
    ``grad_norm/<role>`` (``take_mean_grad_norm``); in place, so a step replayed from a CUDA
    graph counts too.
    """
    params = [p for p in optimizer_params(optimizer) if p.requires_grad]
    scaler = getattr(optimizer, "grad_scaler", None)
    if loss is not None:
        grads = torch.autograd.grad(loss if scaler is None else scaler.scale(loss), params, allow_unused=True)
        for p, g in zip(params, grads):
            p.grad = g if g is not None else torch.zeros_like(p)
    elif scaler is not None:
        raise ValueError("under fp16 apply_update needs the loss, to scale it")
    with_grad = [p for p in params if p.grad is not None]
    for p in with_grad:  # fused Adam needs each gradient in its parameter's memory format (channels-last convs)
        if p.grad.stride() != p.stride():
            p.grad = torch.empty_like(p).copy_(p.grad)
    if distributed.active():
        distributed.average_gradients([p.grad for p in with_grad])
    if scaler is not None:
        scaler.unscale_(optimizer)
    max_norm = getattr(optimizer, "max_grad_norm", None)
    if not with_grad:
        norm = torch.zeros((), device=params[0].device if params else None)
    elif max_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(with_grad, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in with_grad])
    norm = norm.detach()
    stats = getattr(optimizer, "grad_norm_stats", None)
    if stats is None or stats.device != norm.device:
        stats = optimizer.grad_norm_stats = torch.zeros(2, device=norm.device)  # type: ignore[attr-defined]
    stats[0].add_(norm.float())
    stats[1].add_(1.0)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    return norm


def take_mean_grad_norm(optimizer: torch.optim.Optimizer) -> float | None:
    """The mean gradient norm of the optimizer's updates since the last call (None when there
    were none); resets the running ``grad_norm_stats`` in place."""
    stats = getattr(optimizer, "grad_norm_stats", None)
    if stats is None:
        return None
    total, count = stats.tolist()
    stats.zero_()
    return total / count if count else None


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
