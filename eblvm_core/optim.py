"""Optimizers and learning-rate schedules (registered by the core itself) and ``apply_update``,
the one helper every parameter update goes through."""

from __future__ import annotations

import contextlib
import math
import struct
from collections.abc import Iterable, Iterator
from typing import Literal

import attrs
import torch
from torch import Tensor
from torch.optim import optimizer as _torch_optimizer

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
    """Stochastic gradient descent, optionally with momentum; the fused kernel where every parameter
    is a CUDA float tensor (it reads a rate tensor on the device, so a scheduled rate can be replayed
    from a CUDA graph; torch's other SGD kernels read a tensor rate on the host)."""
    params = list(params)
    fused = bool(params) and all(p.is_floating_point() and p.device.type == "cuda" for p in params)
    opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, fused=fused or None)
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
        norm = torch.nn.utils.clip_grad_norm_(with_grad, max_norm).detach()
    else:
        norm = total_norm([p.grad for p in with_grad])
    count_grad_norm(optimizer, norm)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    elif not fused_adam_step_on_cpu(optimizer):
        optimizer.step()
    return norm


def fused_adam_step_on_cpu(optimizer: torch.optim.Optimizer) -> bool:
    """``optimizer.step()`` of a fused ``torch.optim.Adam`` on the CPU, by its kernel directly.

    ``Adam.step`` wraps the kernel (``torch._foreach_add_`` of the step counts, then
    ``torch._fused_adam_``) in Python bookkeeping: a profiler range, the step hooks, state look-ups,
    grouping by device and dtype. On a small model that costs several times the kernel (about 45
    of 55 µs a call here, six calls per BiSM step). This calls the same kernel with the same
    arguments on the same state, under ``no_grad`` as ``step`` runs, so the parameters and moments
    are bit for bit those of ``step``. Returns False, having done nothing, unless all of these
    hold: the optimizer is exactly ``torch.optim.Adam`` with no step hooks (its own or global) and
    no instance-level ``step`` (an LR scheduler's wrapper); every group is fused, without amsgrad,
    capturable, differentiable or decoupled weight decay, with numbers (not tensors) as
    hyper-parameters; every parameter with a gradient is a dense CPU tensor of its group's one
    dtype whose state exists (the first step goes through ``step``, which creates it); no grad
    scaler is attached. CUDA steps always go through ``step`` (graph capture checks its flags there).
    A torch whose private kernel is missing or takes other arguments gets the step counts put
    back and False. ``benchmarks/bench_overhead.py`` checks the result against ``step``'s.
    """
    if (
        type(optimizer) is not torch.optim.Adam
        or "step" in optimizer.__dict__
        or optimizer._optimizer_step_pre_hooks
        or optimizer._optimizer_step_post_hooks
        or _torch_optimizer._global_optimizer_pre_hooks
        or _torch_optimizer._global_optimizer_post_hooks
        or getattr(optimizer, "grad_scale", None) is not None
        or getattr(optimizer, "found_inf", None) is not None
    ):
        return False
    state = optimizer.state
    calls = []
    for group in optimizer.param_groups:
        lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        if (
            not group["fused"]
            or group["amsgrad"]
            or group["capturable"]
            or group["differentiable"]
            or group.get("decoupled_weight_decay", False)
            or not all(type(x) in (float, int) for x in (lr, beta1, beta2, eps, decay))
        ):
            return False
        params, grads, avgs, avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            s = state.get(p)
            if not s or not p.is_cpu or grad.is_sparse or (params and p.dtype != params[0].dtype):
                return False
            params.append(p)
            grads.append(grad)
            avgs.append(s["exp_avg"])
            avg_sqs.append(s["exp_avg_sq"])
            steps.append(s["step"])
        if params:
            calls.append((params, grads, avgs, avg_sqs, steps, lr, beta1, beta2, eps, decay, group["maximize"]))
    with torch.no_grad():
        for i, (params, grads, avgs, avg_sqs, steps, lr, beta1, beta2, eps, decay, maximize) in enumerate(calls):
            torch._foreach_add_(steps, 1)
            try:
                torch._fused_adam_(
                    params,
                    grads,
                    avgs,
                    avg_sqs,
                    [],
                    steps,
                    amsgrad=False,
                    lr=lr,
                    beta1=beta1,
                    beta2=beta2,
                    weight_decay=decay,
                    eps=eps,
                    maximize=maximize,
                    grad_scale=None,
                    found_inf=None,
                )
            except (AttributeError, TypeError):  # a torch whose private kernel is named or called otherwise
                torch._foreach_sub_(steps, 1)
                if i:  # earlier groups are stepped: let torch step the rest, as it would have
                    raise
                return False
    return True


def total_norm(grads: list[Tensor]) -> Tensor:
    """The 2-norm of the gradients taken together, a 0-d tensor on their device, with no host
    synchronisation: ``torch.nn.utils.get_total_norm``'s value (the norm of the per-tensor
    norms) without its Python bookkeeping, which costs more than the arithmetic on a small model
    (six of these per BiSM step); tensors on several devices go through ``get_total_norm``."""
    norms = torch._foreach_norm(grads, 2.0)
    try:
        stacked = torch.stack(norms)
    except RuntimeError:  # norms on several devices
        return torch.nn.utils.get_total_norm(grads).detach()
    return torch.linalg.vector_norm(stacked, 2.0).detach()


def count_grad_norm(optimizer: torch.optim.Optimizer, norm: Tensor) -> None:
    """Add ``norm`` (0-d) and 1 to the optimizer's ``grad_norm_stats`` (sum, count), in place on
    the norm's device, in one operation on views of it made once (``(stats, [sum, count], 1)``)."""
    stats = getattr(optimizer, "grad_norm_stats", None)
    cached = getattr(optimizer, "_grad_norm_views", None)
    if stats is None or stats.device != norm.device:
        stats = optimizer.grad_norm_stats = torch.zeros(2, device=norm.device)  # type: ignore[attr-defined]
    if cached is None or cached[0] is not stats:
        cached = (stats, list(stats.unbind()), torch.ones((), device=stats.device))
        optimizer._grad_norm_views = cached  # type: ignore[attr-defined]
    torch._foreach_add_(cached[1], [norm if norm.dtype == stats.dtype else norm.to(stats.dtype), cached[2]])


def take_mean_grad_norm(optimizer: torch.optim.Optimizer) -> float | None:
    """The mean gradient norm of the optimizer's updates since the last call (None when there
    were none); resets the running ``grad_norm_stats`` in place."""
    stats = getattr(optimizer, "grad_norm_stats", None)
    if stats is None:
        return None
    total, count = stats.tolist()
    stats.zero_()
    return total / count if count else None


# ---- learning rates in device tensors ------------------------------------------------------------


def device_rate(lr: float) -> float:
    """``lr`` rounded to the nearest float32, as a Python float: the rate a CUDA kernel reads from a
    rate tensor (``RateTensors``; the fused Adam and SGD kernels take a float32 one). On a CUDA device
    the trainer rounds every scheduled rate so, whether or not the step is replayed from a graph, so
    that a replayed step (rate read from the tensor) and an eager one (rate given as a number) compute
    with the same double and end at the same bits."""
    return struct.unpack("f", struct.pack("f", lr))[0]


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
        self.slots: list[tuple[dict, Tensor]] = [
            (group, torch.zeros((), dtype=torch.float32, device=group["params"][0].device))
            for optimizer in optimizers
            for group in optimizer.param_groups
            if group["params"]
        ]
        self.written: list[float | None] = [None] * len(self.slots)

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
