"""Shared tools for bi-level estimators: parameters as dicts, differentiable optimizer steps,
Hessian-vector products and linear solvers for implicit gradients.

Parameters travel as ``dict[str, Tensor]`` keyed like ``module.named_parameters()``; vectors
handed to the solvers are flat 1-D tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.nn.utils.parametrize
from torch import Tensor, nn
from torch.func import functional_call

from eblvm_core.contracts import Conditioned, EnergyModel

REPEATED = "eblvm.repeated_step"
"""The name of a profiler range around each repeat of a loop whose repeats do the same operations
(``with torch.profiler.record_function(REPEATED):``, as ``fit_posterior`` wraps each real
lower-level step): a compiled step compiles the repeats once and calls them in turn
(``eblvm_core.inductor``). Outside a trace the range costs about a microsecond."""


class _Call(nn.Module):
    """Holds ``module`` so that ``functional_call`` can swap its parameters around ``fn``."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)


class Functional:
    """Runs code with a module's parameters replaced by a dict.

    ``Functional(posterior).call(params, fn, *args)`` evaluates ``fn(*args)`` while every
    use of ``posterior``'s parameters inside ``fn`` sees ``params`` instead; names missing
    from ``params`` keep the module's own tensors. Plain modules get their parameter slots
    swapped directly (tied parameters together) and restored afterwards, even on error, which
    costs a few microseconds where ``torch.func.functional_call`` costs about 70; modules with
    parametrizations go through ``functional_call``.
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self._wrapper = _Call(module)
        self._parametrized = any(torch.nn.utils.parametrize.is_parametrized(m) for m in module.modules())
        owners: dict[int, list[tuple[nn.Module, str]]] = {}
        names: dict[str, int] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            prefix, _, attr = name.rpartition(".")
            owners.setdefault(id(param), []).append((module.get_submodule(prefix), attr))
            names[name] = id(param)
        self._slots = {name: owners[key] for name, key in names.items()}

    def call(self, params: dict[str, Tensor], fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._parametrized:
            swapped = {f"module.{name}": value for name, value in params.items()}
            return functional_call(self._wrapper, swapped, (fn, *args), kwargs, strict=False)
        saved = []
        try:
            for name, value in params.items():
                for owner, attr in self._slots[name]:
                    saved.append((owner, attr, owner._parameters[attr]))
                    owner._parameters[attr] = value  # type: ignore[assignment]
            return fn(*args, **kwargs)
        finally:
            for owner, attr, original in reversed(saved):
                owner._parameters[attr] = original

    def method(self, params: dict[str, Tensor], name: str, *args: Any, **kwargs: Any) -> Any:
        """``module.<name>(*args)`` under ``params``."""
        return self.call(params, getattr(self.module, name), *args, **kwargs)


if TYPE_CHECKING:
    from eblvm_core.roles import TrainingRole


def trainable(module: nn.Module) -> dict[str, Tensor]:
    """The parameters of ``module`` that require grad, by name."""
    return {name: p for name, p in module.named_parameters() if p.requires_grad}


def grads_or_zeros(outputs: Tensor | Sequence[Tensor], inputs: Sequence[Tensor], **kwargs: Any) -> list[Tensor]:
    """``torch.autograd.grad`` with zeros for inputs the outputs do not depend on."""
    grads = torch.autograd.grad(outputs, list(inputs), allow_unused=True, **kwargs)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads)]


def flat(tensors: Sequence[Tensor]) -> Tensor:
    """Concatenate tensors into one vector."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unflat(vector: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    """Split a vector into tensors shaped like ``like``."""
    return [part.view_as(t) for part, t in zip(vector.split([t.numel() for t in like]), like)]


def sgd_step(params: dict[str, Tensor], grads: Sequence[Tensor], lr: float) -> dict[str, Tensor]:
    """One differentiable gradient-descent step p - lr·g (BiSM Eq. 13)."""
    return {name: torch.add(p, g, alpha=-lr) for (name, p), g in zip(params.items(), grads)}


@attrs.define
class DifferentiableAdam:
    """A differentiable copy of a ``torch.optim.Adam``: same hyper-parameters and state.

    ``step`` returns new parameters (functions of the gradients, so of θ through them) and
    advances its own moments; the real optimizer is left untouched. Weight decay is the
    L2 form of ``torch.optim.Adam``; gradient clipping is not reproduced. The copied second
    moment starts 1e-30 above the real one, so the square root never sees 0 and its
    derivative stays finite. The step counts stay tensors on the optimizer's device (never
    read on the host), so the copy can be captured in a CUDA graph.
    """

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step_count: Tensor  # (P,) steps taken per parameter, in the first parameter's dtype and device
    exp_avg: list[Tensor]
    exp_avg_sq: list[Tensor]

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer, params: Sequence[Tensor]) -> DifferentiableAdam:
        """Copy hyper-parameters and state of ``optimizer`` (an Adam) for ``params``."""
        if not isinstance(optimizer, torch.optim.Adam):
            raise TypeError(f"a differentiable Adam step needs a torch.optim.Adam, got {type(optimizer).__name__}")
        group = next(g for g in optimizer.param_groups if any(p is params[0] for p in g["params"]))
        if group["amsgrad"] or group["maximize"]:
            raise ValueError("the differentiable Adam step supports neither amsgrad nor maximize")
        like = params[0]
        steps, avg, avg_sq = [], [], []
        for p in params:
            state = optimizer.state.get(p, {})
            step = state.get("step", 0.0)
            steps.append(torch.as_tensor(step, dtype=like.dtype).to(like.device).reshape(()))
            avg.append(state["exp_avg"].detach() if "exp_avg" in state else torch.zeros_like(p))
            avg_sq.append(state["exp_avg_sq"].detach() + 1e-30 if "exp_avg_sq" in state else torch.full_like(p, 1e-30))
        beta1, beta2 = group["betas"]
        return cls(group["lr"], beta1, beta2, group["eps"], group["weight_decay"], torch.stack(steps), avg, avg_sq)

    def step(self, params: dict[str, Tensor], grads: Sequence[Tensor]) -> dict[str, Tensor]:
        """One Adam step from ``params`` along ``grads``, differentiable in both.

        p − lr/(1−β1ᵗ) · m / (√(v/(1−β2ᵗ)) + eps), written as p − a·m / (√v + eps·√(1−β2ᵗ))
        with a = lr·√(1−β2ᵗ)/(1−β1ᵗ): fewer graph nodes, the same values. The factors of all
        parameters are computed together, from their step counts.
        """
        self.step_count = self.step_count + 1
        root = (1 - self.beta2**self.step_count).sqrt()
        scale = -self.lr * root / (1 - self.beta1**self.step_count)
        eps_root = self.eps * root
        out = {}
        for i, ((name, p), g) in enumerate(zip(params.items(), grads)):
            if self.weight_decay:
                g = torch.add(g, p, alpha=self.weight_decay)
            self.exp_avg[i] = torch.lerp(self.exp_avg[i], g, 1 - self.beta1)
            self.exp_avg_sq[i] = torch.addcmul(self.beta2 * self.exp_avg_sq[i], g, g, value=1 - self.beta2)
            out[name] = torch.addcdiv(p, scale[i] * self.exp_avg[i], self.exp_avg_sq[i].sqrt() + eps_root[i])
        return out


def hvp(grads: Sequence[Tensor], params: Sequence[Tensor], vector: Sequence[Tensor]) -> list[Tensor]:
    """Hessian-vector product by double backward: ∂(gradsᵀ·vector)/∂params.

    ``grads`` must come from ``torch.autograd.grad(..., params, create_graph=True)``; the
    graph is retained so the product can be taken again.
    """
    pairs = [(g, v) for g, v in zip(grads, vector) if g.requires_grad]
    if not pairs:
        return [torch.zeros_like(p) for p in params]
    outs, vecs = zip(*pairs)
    return grads_or_zeros(outs, params, grad_outputs=vecs, retain_graph=True)


@attrs.frozen
class SolveInfo:
    """How a linear solve ended: iterations used and the final relative residual (CG) or
    relative size of the last Neumann term; 0-d tensors from a solve of fixed length (``fixed``),
    which reads nothing on the host."""

    iterations: int | Tensor
    residual: float | Tensor


def conjugate_gradient(
    matvec: Callable[[Tensor], Tensor],
    b: Tensor,
    iterations: int = 20,
    tol: float = 1e-6,
    damping: float = 0.0,
    fixed: bool = False,
) -> tuple[Tensor, SolveInfo]:
    """Solve (A + damping·I) x = b for symmetric A given only x ↦ Ax, from x = 0.

    Stops when ‖r‖ ≤ tol·‖b‖ or after ``iterations``; on a direction of non-positive
    curvature (A not positive definite there) it stops and returns the iterate reached so
    far (x = 0 if that happens at once: the implicit correction is then dropped). ``fixed``
    takes exactly ``iterations`` steps and decides nothing on the host (a compiled step): the
    tolerance is not read, and from a non-positive curvature on (or once the residual is 0) the
    iterate stays where it is.
    """
    if fixed:
        return _conjugate_gradient_fixed(matvec, b, iterations, damping)
    x = torch.zeros_like(b)
    r, p = b.clone(), b.clone()
    rr = r.dot(r)
    b_norm = float(rr.sqrt())
    if b_norm == 0.0:
        return x, SolveInfo(0, 0.0)
    done = 0
    for k in range(1, iterations + 1):
        ap = matvec(p) + damping * p
        curvature = p.dot(ap)
        if curvature <= 0:
            break
        alpha = rr / curvature
        x = x + alpha * p
        r = r - alpha * ap
        rr_new = r.dot(r)
        p = r + (rr_new / rr) * p
        rr, done = rr_new, k
        if float(rr.sqrt()) <= tol * b_norm:
            break
    return x, SolveInfo(done, float(rr.sqrt()) / b_norm)


def _conjugate_gradient_fixed(
    matvec: Callable[[Tensor], Tensor], b: Tensor, iterations: int, damping: float
) -> tuple[Tensor, SolveInfo]:
    """``conjugate_gradient``'s iterations, ``iterations`` of them, each masked off once the
    curvature is not positive or the residual vanished; iterations counts the steps taken."""
    x = torch.zeros_like(b)
    r, p = b.clone(), b.clone()
    rr = r.dot(r)
    b_norm = rr.sqrt()
    active = b_norm > 0
    done = torch.zeros((), dtype=b.dtype, device=b.device)
    for _ in range(iterations):
        ap = matvec(p) + damping * p
        curvature = p.dot(ap)
        active = active & (curvature > 0) & (rr > 0)
        alpha = torch.where(active, rr / torch.where(active, curvature, 1.0), 0.0)
        x = x + alpha * p
        r = r - alpha * ap
        rr_new = r.dot(r)
        p = torch.where(active, r + (rr_new / torch.where(active, rr, 1.0)) * p, p)
        rr = torch.where(active, rr_new, rr)
        done = done + active.to(done.dtype)
    return x, SolveInfo(done, torch.where(b_norm > 0, rr.sqrt() / b_norm.clamp_min(torch.finfo(b.dtype).tiny), 0.0))


def neumann(
    matvec: Callable[[Tensor], Tensor],
    b: Tensor,
    iterations: int = 20,
    tol: float = 1e-6,
    damping: float = 0.0,
    step: float = 0.1,
    fixed: bool = False,
) -> tuple[Tensor, SolveInfo]:
    """Approximate (A + damping·I)⁻¹ b by the truncated series step·Σ_k (I − step·(A + damping·I))^k b.

    Converges when the eigenvalues of step·(A + damping·I) lie in (0, 2); stops once a term
    is smaller than tol·‖b‖. ``fixed`` sums exactly ``iterations`` terms and reads nothing on the
    host (a compiled step).
    """
    term, total = b.clone(), b.clone()
    if fixed:
        for _ in range(iterations):
            term = term - step * (matvec(term) + damping * term)
            total = total + term
        norm = b.norm()
        last = torch.where(norm > 0, term.norm() / norm.clamp_min(torch.finfo(b.dtype).tiny), 0.0)
        return step * total, SolveInfo(torch.tensor(float(iterations), dtype=b.dtype, device=b.device), last)
    b_norm = float(b.norm())
    if b_norm == 0.0:
        return torch.zeros_like(b), SolveInfo(0, 0.0)
    size, k = 1.0, 0
    for k in range(1, iterations + 1):  # noqa: B007 - k is reported after the loop
        term = term - step * (matvec(term) + damping * term)
        total = total + term
        size = float(term.norm()) / b_norm
        if size <= tol:
            break
    return step * total, SolveInfo(k, size)


def condition_on(model: EnergyModel | Conditioned, x: Tensor, graph: bool = True) -> EnergyModel | Conditioned:
    """The energy to evaluate at the points x for many h at the current θ: what the lower
    level's divergence receives as its ``model``.

    - ``model`` conditioned on x already: itself, or with ``graph=False`` its detached copy.
    - a model with ``has_conditioning``: ``model.condition(x)``, its features of x computed now,
      once: with their graph to θ (and to x if x requires grad) when ``graph``, else under
      ``no_grad`` (for steps that give θ no gradient: no graph is recorded or kept).
    - any other model (the GRBM, third-party models): the model itself, evaluated in full at
      every call as it always was.
    """
    if isinstance(model, Conditioned):
        if model.conditions(x):
            return model if graph else model.detach()
        model = model.model
    if not model.has_conditioning:
        return model
    if graph:
        return model.condition(x)
    with torch.no_grad():
        return model.condition(x)


def weighted_mean(values: Tensor, weights: Tensor | None) -> Tensor:
    """mean w_i·values_i of (B,) values (0-d); None weights: the plain mean."""
    return values.mean() if weights is None else (weights * values).mean()


def fit_posterior(
    divergence: Any,
    model: EnergyModel | Conditioned,
    posterior: nn.Module,
    role: TrainingRole,
    x: Tensor,
    steps: int,
    weights: Tensor | None = None,
) -> dict[str, Tensor]:
    """``steps`` real updates of φ (the posterior's ``role``) on the lower level G = mean
    w·D(q(h|x) ‖ p(h|x)) (``weights`` w (B,), None: all 1); θ is not touched.

    The divergence gets ``condition_on(model, x, graph=False)``: a model that conditions has its
    features of x computed once for all the steps, outside the graph (θ gets no gradient here);
    ``model`` may be such a Conditioned on x already (its detached copy is used). Returns the
    last ``lower_loss`` as a 0-d tensor (empty when steps = 0).
    """
    lower = None
    energy = condition_on(model, x, graph=False) if steps else model
    for _ in range(steps):
        with torch.profiler.record_function(REPEATED):
            lower = weighted_mean(divergence(energy, posterior, x), weights)
            role.update(lower)
    return {} if lower is None else {"lower_loss": lower.detach()}
