"""eblvm_core.bilevel: functional calls, differentiable optimizer steps, HVPs and solvers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from eblvm_core.bilevel import (
    DifferentiableAdam,
    Functional,
    conjugate_gradient,
    flat,
    grads_or_zeros,
    hvp,
    neumann,
    sgd_step,
    trainable,
    unflat,
)


def spd(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, n, generator=g, dtype=torch.float64)
    return q @ q.T / n + 0.5 * torch.eye(n, dtype=torch.float64)


@pytest.mark.parametrize("damping", [0.0, 0.3])
def test_conjugate_gradient_solves_a_known_spd_system(damping):
    a = spd(12)
    b = torch.randn(12, dtype=torch.float64)
    x, info = conjugate_gradient(lambda v: a @ v, b, iterations=50, tol=1e-12, damping=damping)
    expected = torch.linalg.solve(a + damping * torch.eye(12, dtype=torch.float64), b)
    torch.testing.assert_close(x, expected, rtol=1e-9, atol=1e-10)
    assert info.iterations <= 13 and info.residual <= 1e-12


def test_conjugate_gradient_respects_the_iteration_budget_and_zero_rhs():
    a = spd(12, seed=1)
    b = torch.randn(12, dtype=torch.float64)
    _, info = conjugate_gradient(lambda v: a @ v, b, iterations=3, tol=0.0)
    assert info.iterations == 3 and info.residual > 0
    x, info = conjugate_gradient(lambda v: a @ v, torch.zeros(12, dtype=torch.float64))
    assert info.iterations == 0 and not x.any()


def test_conjugate_gradient_stops_on_negative_curvature():
    a = -spd(6)
    x, info = conjugate_gradient(lambda v: a @ v, torch.ones(6, dtype=torch.float64), iterations=10)
    assert info.iterations == 0 and torch.isfinite(x).all() and not x.any()


def test_conjugate_gradient_keeps_the_iterate_reached_before_negative_curvature():
    a = torch.diag(torch.tensor([1.0, -0.1], dtype=torch.float64))  # indefinite
    b = torch.ones(2, dtype=torch.float64)
    x, info = conjugate_gradient(lambda v: a @ v, b, iterations=10)
    torch.testing.assert_close(x, b * 2 / 0.9)  # the first step along b, then p·Ap < 0
    assert info.iterations == 1 and info.residual == pytest.approx(float((b - a @ x).norm() / b.norm()))


@pytest.mark.parametrize("damping", [0.0, 0.3])
def test_neumann_series_solves_a_known_spd_system(damping):
    a = spd(8)
    b = torch.randn(8, dtype=torch.float64)
    step = 1.0 / float(torch.linalg.eigvalsh(a).max() + damping)
    x, info = neumann(lambda v: a @ v, b, iterations=2000, tol=1e-12, damping=damping, step=step)
    expected = torch.linalg.solve(a + damping * torch.eye(8, dtype=torch.float64), b)
    torch.testing.assert_close(x, expected, rtol=1e-8, atol=1e-9)
    assert info.residual <= 1e-12 and info.iterations < 2000


def test_neumann_truncation_is_the_partial_sum():
    a = spd(5)
    b = torch.randn(5, dtype=torch.float64)
    x, info = neumann(lambda v: a @ v, b, iterations=2, tol=0.0, step=0.1)
    m = torch.eye(5, dtype=torch.float64) - 0.1 * a
    torch.testing.assert_close(x, 0.1 * (b + m @ b + m @ m @ b))
    assert info.iterations == 2


def test_hvp_matches_the_explicit_hessian():
    a = spd(4)
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(3, dtype=torch.float64, requires_grad=True)
    loss = 0.5 * x @ a @ x + (x[:3] * y).sum() ** 2
    grads = torch.autograd.grad(loss, [x, y], create_graph=True)
    vx, vy = torch.randn(4, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    full = torch.autograd.functional.hessian(lambda x_, y_: 0.5 * x_ @ a @ x_ + (x_[:3] * y_).sum() ** 2, (x, y))
    h = torch.cat([torch.cat([full[0][0], full[0][1]], 1), torch.cat([full[1][0], full[1][1]], 1)])
    product = hvp(grads, [x, y], [vx, vy])
    torch.testing.assert_close(flat(product), h @ torch.cat([vx, vy]))
    torch.testing.assert_close(flat(hvp(grads, [x, y], [vx, vy])), flat(product))  # the graph is retained


def test_hvp_of_gradients_without_graph_is_zero():
    p = torch.randn(3, requires_grad=True)
    (g,) = torch.autograd.grad((2 * p).sum(), [p], create_graph=True)
    assert not hvp([g], [p], [torch.ones(3)])[0].any()


def test_flat_unflat_and_grads_or_zeros():
    a, b = torch.randn(2, 3), torch.randn(4)
    parts = unflat(flat([a, b]), [a, b])
    assert torch.equal(parts[0], a) and torch.equal(parts[1], b)
    x, unused = torch.randn(3, requires_grad=True), torch.randn(2, requires_grad=True)
    gx, gu = grads_or_zeros((x**2).sum(), [x, unused])
    torch.testing.assert_close(gx, 2 * x.detach())
    assert gu.shape == (2,) and not gu.any()


def test_functional_call_swaps_parameters_without_touching_the_module():
    lin = nn.Linear(3, 2).double()
    before = {k: v.clone() for k, v in lin.state_dict().items()}
    params = {k: torch.randn_like(v, requires_grad=True) for k, v in trainable(lin).items()}
    x = torch.randn(5, 3, dtype=torch.float64)
    f = Functional(lin)
    out = f.call(params, lambda z: lin(z).sum(), x)
    expected = (x @ params["weight"].T + params["bias"]).sum()
    torch.testing.assert_close(out, expected)
    grads = torch.autograd.grad(out, list(params.values()))
    torch.testing.assert_close(grads[1], torch.full((2,), 5.0, dtype=torch.float64))
    torch.testing.assert_close(f.method(params, "forward", x), x @ params["weight"].T + params["bias"])
    partial = f.call({"bias": params["bias"]}, lin, x)  # names left out keep the module's tensors
    torch.testing.assert_close(partial, x @ before["weight"].T + params["bias"])
    for k, v in lin.state_dict().items():
        assert torch.equal(v, before[k])


def test_functional_call_swaps_tied_parameters_together_and_restores_them_on_error():
    first, second = nn.Linear(2, 2, bias=False).double(), nn.Linear(2, 2, bias=False).double()
    second.weight = first.weight  # tied
    net = nn.Sequential(first, nn.Tanh(), second)
    f = Functional(net)
    weight = torch.randn(2, 2, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, 2, dtype=torch.float64)
    out = f.call({"0.weight": weight}, net, x)
    torch.testing.assert_close(out, torch.tanh(x @ weight.T) @ weight.T)
    original = first.weight

    def fails(_):
        raise RuntimeError("inside")

    with pytest.raises(RuntimeError, match="inside"):
        f.call({"0.weight": weight}, fails, x)
    assert first.weight is original and second.weight is original


def test_functional_call_handles_parametrized_modules():
    lin = nn.Linear(3, 3, bias=False).double()
    torch.nn.utils.parametrize.register_parametrization(lin, "weight", Symmetric())
    f = Functional(lin)
    raw = torch.randn(3, 3, dtype=torch.float64)
    x = torch.randn(2, 3, dtype=torch.float64)
    out = f.call({"parametrizations.weight.original": raw}, lin, x)
    symmetric = raw.triu() + raw.triu(1).T
    torch.testing.assert_close(out, x @ symmetric.T)


class Symmetric(nn.Module):
    def forward(self, x):
        return x.triu() + x.triu(1).transpose(-1, -2)


def test_sgd_step_is_differentiable():
    p = torch.randn(3, dtype=torch.float64, requires_grad=True)
    g = p**2
    new = sgd_step({"p": p}, [g], lr=0.1)["p"]
    torch.testing.assert_close(new, p - 0.1 * p**2)
    (d,) = torch.autograd.grad(new.sum(), p)
    torch.testing.assert_close(d, 1 - 0.2 * p.detach())


def _adam_pair(weight_decay: float, warm_steps: int):
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
    b = nn.Parameter(torch.randn(3, dtype=torch.float64))
    opt = torch.optim.Adam([w, b], lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=weight_decay)
    x = torch.randn(7, 4, dtype=torch.float64)

    def loss():
        return ((x @ w + b).tanh() ** 2).sum()

    for _ in range(warm_steps):
        opt.zero_grad()
        loss().backward()
        opt.step()
    return w, b, opt, loss


@pytest.mark.parametrize("weight_decay,warm_steps", [(0.0, 0), (0.0, 3), (0.1, 4)])
def test_differentiable_adam_matches_torch_adam(weight_decay, warm_steps):
    w, b, opt, loss = _adam_pair(weight_decay, warm_steps)
    diff = DifferentiableAdam.from_optimizer(opt, [w, b])
    params = {"w": w.detach().clone(), "b": b.detach().clone()}
    for _ in range(3):  # several steps: the copied moments advance like the real ones
        grads = torch.autograd.grad(loss(), [w, b])
        params = diff.step(params, grads)
        opt.zero_grad()
        loss().backward()
        opt.step()
        torch.testing.assert_close(params["w"], w.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(params["b"], b.detach(), rtol=1e-12, atol=1e-12)
        params = {"w": w.detach().clone(), "b": b.detach().clone()}


def test_differentiable_adam_step_is_differentiable_and_leaves_the_optimizer_alone():
    w, b, opt, loss = _adam_pair(0.0, 2)
    state = {k: v.clone() for k, v in opt.state[w].items()}
    scale = torch.tensor(1.3, dtype=torch.float64, requires_grad=True)

    def new_w(s):
        diff = DifferentiableAdam.from_optimizer(opt, [w, b])
        grads = torch.autograd.grad(loss(), [w, b], create_graph=True)
        return diff.step({"w": w, "b": b}, [s * grads[0], grads[1]])["w"].sum()

    (analytic,) = torch.autograd.grad(new_w(scale), scale)
    h = 1e-6
    numeric = (new_w(scale.detach() + h) - new_w(scale.detach() - h)) / (2 * h)
    torch.testing.assert_close(analytic, numeric.detach(), rtol=1e-5, atol=1e-8)
    for k, v in opt.state[w].items():
        assert torch.equal(v, state[k])


def test_differentiable_adam_refuses_other_optimizers():
    p = nn.Parameter(torch.zeros(2))
    with pytest.raises(TypeError):
        DifferentiableAdam.from_optimizer(torch.optim.SGD([p], lr=0.1), [p])
    with pytest.raises(ValueError):
        DifferentiableAdam.from_optimizer(torch.optim.Adam([p], amsgrad=True), [p])


def test_differentiable_adam_has_finite_derivatives_where_gradients_are_zero():
    p = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = torch.optim.Adam([p], lr=0.1)
    s = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    diff = DifferentiableAdam.from_optimizer(opt, [p])
    new = diff.step({"p": p}, [s * torch.tensor([0.0, 1.0], dtype=torch.float64)])["p"]
    (d,) = torch.autograd.grad(new.sum(), s)
    assert torch.isfinite(new).all() and torch.isfinite(d)
