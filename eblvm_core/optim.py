"""Optimizers (registered by the core itself) and the one helper estimators update through."""

from __future__ import annotations

from typing import Iterable

import attrs
import torch
from torch import Tensor

from eblvm_core.config import non_negative, option, positive
from eblvm_core.hookspecs import hookimpl


@attrs.frozen
class AdamConfig:
    lr: float = option(1e-3, "learning rate", positive)
    beta1: float = option(0.9, "first-moment decay")
    beta2: float = option(0.999, "second-moment decay")
    eps: float = option(1e-8, "denominator offset", positive)
    weight_decay: float = option(0.0, "L2 penalty", non_negative)
    max_grad_norm: float | None = option(None, "clip the gradient norm to this value")


@attrs.frozen
class SGDConfig:
    lr: float = option(1e-2, "learning rate", positive)
    momentum: float = option(0.0, "momentum", non_negative)
    weight_decay: float = option(0.0, "L2 penalty", non_negative)
    max_grad_norm: float | None = option(None, "clip the gradient norm to this value")


def adam(cfg: AdamConfig, params: Iterable[Tensor]) -> torch.optim.Optimizer:
    """Adam (Kingma & Ba); the fused kernel where every parameter is a CPU or CUDA float tensor."""
    params = list(params)
    fused = bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    opt = torch.optim.Adam(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay,
                           fused=fused or None)
    opt.max_grad_norm = cfg.max_grad_norm  # type: ignore[attr-defined]
    return opt


def sgd(cfg: SGDConfig, params: Iterable[Tensor]) -> torch.optim.Optimizer:
    """Stochastic gradient descent, optionally with momentum."""
    opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    opt.max_grad_norm = cfg.max_grad_norm  # type: ignore[attr-defined]
    return opt


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def apply_update(optimizer: torch.optim.Optimizer, loss: Tensor | None = None, measure: bool = True) -> float:
    """Backward ``loss`` into the optimizer's parameters (if given), clip, and step.

    With ``loss`` the gradients of the optimizer's parameters are replaced (zeros where the
    loss does not reach), so a caller that fills ``.grad`` itself passes ``loss=None``. Returns the gradient norm before
    clipping, or NaN when ``measure`` is false and there is no clipping (which saves work).
    """
    params = [p for p in optimizer_params(optimizer) if p.requires_grad]
    if loss is not None:
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        for p, g in zip(params, grads):
            p.grad = g if g is not None else torch.zeros_like(p)
    max_norm = getattr(optimizer, "max_grad_norm", None)
    with_grad = [p for p in params if p.grad is not None]
    norm = float("nan")
    if max_norm is not None:
        norm = float(torch.nn.utils.clip_grad_norm_(with_grad, max_norm))
    elif measure:
        norm = float(torch.nn.utils.get_total_norm([p.grad for p in with_grad])) if with_grad else 0.0
    optimizer.step()
    return norm


@hookimpl
def register_optimizers(register):
    register("adam", adam, AdamConfig)
    register("sgd", sgd, SGDConfig)
