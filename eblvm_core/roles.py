"""Training roles: each set of parameters an estimator trains (``model`` and ``posterior``; BiDVL's
``energy``, ``encoder`` and ``generator``) is one ``TrainingRole`` that owns its optimizer, its
learning-rate schedule, its gradient clipping, its gradient scaler (fp16), its parameter average
(EMA) and the statistics of its gradient norms, with one ``state_dict`` for all of it.
``TrainingRole.update`` is the one way parameters change. ``Precision`` is ``[run] precision`` on
a device: the autocast a training step runs in and the scaler each role gets."""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from eblvm_core import distributed

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """``[run] precision`` ("fp32", "bf16" or "fp16") of the training steps on ``device_type``."""

    def __init__(self, name: str = "fp32", device_type: str = "cpu"):
        self.name, self.device_type = name, device_type

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context a training step runs in: autocast to bf16 or fp16, or nothing for fp32.
        Autocast's cache of weight casts is off: a step that updates parameters in place and runs
        them again (the K lower-level steps of BiSM and VaGES, BiDVL's second level after its
        first) would otherwise reuse the casts made before the update, since the cache lives until
        the outermost autocast region ends; a CUDA graph needs the cache off too."""
        dtype = AUTOCAST.get(self.name)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=dtype, cache_enabled=False)

    def scaler(self) -> torch.amp.GradScaler | None:
        """A fresh gradient scaler for one role under fp16 (None otherwise)."""
        return torch.amp.GradScaler(self.device_type) if self.name == "fp16" else None


class TrainingRole:
    """The parameters of one role and everything that steps them.

    ``schedule`` is a ``contracts.Schedule`` (None: the constant rate).
    ``update(loss)`` backpropagates ``loss`` into the parameters (or takes the gradients the caller
    put in ``.grad``), averages them over the ranks, clips their norm to ``max_grad_norm``, and
    steps the optimizer (through the scaler under fp16). ``set_lr`` puts the schedule's rate for a
    step into the optimizer; ``update_average``/``averaged`` keep and lend the EMA of the
    parameters (decay ``ema``, None: none).
    """

    def __init__(
        self,
        name: str,
        optimizer: torch.optim.Optimizer,
        schedule: Any = None,
        max_grad_norm: float | None = None,
        scaler: torch.amp.GradScaler | None = None,
        ema: float | None = None,
    ):
        self.name, self.optimizer = name, optimizer
        self.schedule = schedule
        self.max_grad_norm, self.scaler, self.ema = max_grad_norm, scaler, ema
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.params: list[Tensor] = [p for group in optimizer.param_groups for p in group["params"]]
        self.average: list[Tensor] | None = None  # with an EMA, from ``start_average`` on
        self._norms: tuple[Tensor, list[Tensor], Tensor] | None = None  # (sum and count, their views, 1)

    # ---- the update -----------------------------------------------------------------------
    def update(self, loss: Tensor | None = None) -> Tensor:
        """Step the role's parameters on ``loss`` (its gradients replace theirs, zeros where it
        does not reach) or, with None, on the gradients already in ``.grad``. With a process group
        the gradients are first averaged over the ranks (bucketed all-reduces), so every rank takes
        the step of the mean of their losses; every rank must hand over the same parameters. Under
        fp16 the loss is scaled, the gradients unscaled, and a step with non-finite gradients
        skipped. Returns the norm of the (averaged) gradient before clipping, a 0-d tensor (no host
        synchronisation), and adds it to the statistics ``take_mean_grad_norm`` reads, in place on
        the device, so a step replayed from a CUDA graph counts too."""
        params = [p for p in self.params if p.requires_grad]
        scaler = self.scaler
        if loss is not None:
            grads = torch.autograd.grad(loss if scaler is None else scaler.scale(loss), params, allow_unused=True)
            for p, g in zip(params, grads):
                p.grad = g if g is not None else torch.zeros_like(p)
        elif scaler is not None:
            raise ValueError("under fp16 a role's update needs the loss, to scale it")
        with_grad: list[Tensor] = []
        given: list[Tensor] = []  # the gradients of ``with_grad``, in order
        for p in params:  # fused Adam needs each gradient in its parameter's memory format (channels-last convs)
            grad = p.grad
            if grad is None:
                continue
            if grad.stride() != p.stride():
                grad = p.grad = torch.empty_like(p).copy_(grad)
            with_grad.append(p)
            given.append(grad)
        if distributed.active():
            distributed.average_gradients(given)
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        if not with_grad:
            norm = torch.zeros((), device=params[0].device if params else None)
        elif self.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(with_grad, self.max_grad_norm).detach()
        else:
            norm = total_norm(given)
        self._count_grad_norm(norm)
        if scaler is not None:
            scaler.step(self.optimizer)
            scaler.update()
        else:
            self.optimizer.step()
        return norm

    def prepare_state(self) -> None:
        """Create now what the first update creates lazily, the optimizer's state and the
        gradient-norm statistics, with the values that update starts from and nothing stepped
        changed: one optimizer step on zero gradients makes the state, then the parameters are put
        back and the new state zeroed (a fresh Adam's moments and count; an SGD momentum buffer,
        which its first step fills with the gradient, as zero plus the gradient). A compiled step
        is traced once on this state (``compiled``)."""
        params = [p for p in self.params if p.requires_grad]
        fresh = [p for p in params if not self.optimizer.state.get(p)]
        if fresh:
            saved, grads = [p.detach().clone() for p in params], [p.grad for p in params]
            for p in params:
                p.grad = torch.zeros_like(p)
            self.optimizer.step()
            with torch.no_grad():
                for p, value, grad in zip(params, saved, grads):
                    p.copy_(value)
                    p.grad = grad
                for p in fresh:
                    for value in self.optimizer.state[p].values():
                        if isinstance(value, Tensor):
                            value.zero_()
        if self._norms is None and params:
            self._grad_norm_stats(params[0].device)

    def state_tensors(self) -> list[Tensor]:
        """The tensors an update changes besides the parameters: the optimizer's state and the
        gradient-norm statistics (their storage and the views the update adds to)."""
        found = [v for state in self.optimizer.state.values() for v in state.values() if isinstance(v, Tensor)]
        if self._norms is not None:
            stats, views, one = self._norms
            found += [stats, *views, one]
        return found

    def _grad_norm_stats(self, device: torch.device) -> tuple[Tensor, list[Tensor], Tensor]:
        """The gradient-norm statistics on ``device``: (sum and count, their views, 1), made once
        (zero) and made again (zero) only where they live on another device."""
        norms = self._norms
        if norms is None or norms[0].device != device:
            stats = torch.zeros(2, device=device)
            norms = self._norms = (stats, list(stats.unbind()), torch.ones((), device=device))
        return norms

    def _count_grad_norm(self, norm: Tensor) -> None:
        """Add ``norm`` (0-d) and 1 to the running (sum, count), in one in-place operation on
        views made once, on the norm's device."""
        stats, views, one = self._grad_norm_stats(norm.device)
        torch._foreach_add_(views, [norm if norm.dtype == stats.dtype else norm.to(stats.dtype), one])

    def take_mean_grad_norm(self) -> float | None:
        """The mean gradient norm of the updates since the last call (None when there were none);
        the statistics start again from zero."""
        if self._norms is None:
            return None
        stats = self._norms[0]
        total, count = stats.tolist()
        stats.zero_()
        return total / count if count else None

    # ---- the learning rate -------------------------------------------------------------------
    @property
    def scheduled(self) -> bool:
        """Whether the rate changes during the run (a schedule other than the constant one)."""
        return self.schedule is not None and not self.schedule.constant

    @property
    def lr(self) -> float:
        """The first parameter group's current rate (what ``lr/<role>`` logs)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def set_lr(self, step: int, total_steps: int, steps_per_epoch: int, device_rates: bool = False) -> None:
        """Each parameter group's rate for ``step`` from the schedule and the group's base rate.
        ``device_rates`` (a CUDA device) rounds a scheduled rate to float32 (``optim.device_rate``),
        the value a graph-replayed step reads from its rate tensor, so that replayed and eager runs
        step alike; on the CPU the rate is the float itself."""
        if not self.scheduled:
            return
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            lr = self.schedule.lr(base, step, total_steps, steps_per_epoch)
            group["lr"] = device_rate(lr) if device_rates else lr

    # ---- the parameter average (EMA) ---------------------------------------------------------
    def start_average(self) -> None:
        """With an EMA, start the average at the current parameters (the run's state does so once
        the parameters are those training starts from)."""
        if self.ema is not None:
            self.average = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update_average(self) -> None:
        """average ← average + (1 − ema)·(parameters − average), after each step."""
        if self.average is not None and self.ema is not None:  # an average exists only with an EMA
            torch._foreach_lerp_(self.average, self.params, 1.0 - self.ema)

    @contextlib.contextmanager
    def averaged(self) -> Iterator[None]:
        """Within the block the parameters hold their average (no change without an EMA)."""
        if self.average is None:
            yield
            return
        with torch.no_grad():
            saved = [p.detach().clone() for p in self.params]
            torch._foreach_copy_(self.params, self.average)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self.params, saved)

    @torch.no_grad()
    def use_average(self) -> None:
        """Put the average in place of the parameters for good (evaluating or sampling a saved run)."""
        if self.average is not None:
            torch._foreach_copy_(self.params, self.average)

    # ---- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state, and the scaler's, the average and the gradient-norm statistics
        since the last log step where the role has them."""
        state: dict[str, Any] = {"optimizer": self.optimizer.state_dict()}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        if self.average is not None:
            state["ema"] = self.average
        if self._norms is not None:
            state["grad_norms"] = self._norms[0].detach().clone()  # (sum, count) since the last log step
        return state

    def load_state_dict(self, state: dict[str, Any], training: bool = True) -> None:
        """Restore ``state_dict()``: the average always (evaluations use it), the optimizer, the
        scaler and the gradient statistics only with ``training``."""
        if self.average is not None and "ema" in state:
            self.average = [v.to(p) for v, p in zip(state["ema"], self.average, strict=True)]
        if not training:
            return
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        if "grad_norms" in state:
            stats = state["grad_norms"]
            self._grad_norm_stats(stats.device)[0].copy_(stats)


@contextlib.contextmanager
def averaged(roles: Iterable[TrainingRole]) -> Iterator[None]:
    """Within the block every role with an EMA holds its averaged parameters."""
    with contextlib.ExitStack() as stack:
        for role in roles:
            stack.enter_context(role.averaged())
        yield


# ---- stepping -------------------------------------------------------------------------------------


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


def device_rate(lr: float) -> float:
    """``lr`` rounded to the nearest float32, as a Python float: the rate a CUDA kernel reads from a
    rate tensor (``RateTensors``; the fused Adam and SGD kernels take a float32 one). On a CUDA device
    the trainer rounds every scheduled rate so, whether or not the step is replayed from a graph, so
    that a replayed step (rate read from the tensor) and an eager one (rate given as a number) compute
    with the same double and end at the same bits."""
    return struct.unpack("f", struct.pack("f", lr))[0]
