"""A role's update against torch's own code: the gradient norm and its running statistics equal torch's."""

from __future__ import annotations

import pytest
import torch

from eblvm_core.roles import TrainingRole, total_norm


def twin_params(seed: int = 0) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """Two identical sets of parameters (a matrix, a vector, one that gets no gradient)."""
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen), torch.randn(2, generator=gen)]
    return [torch.nn.Parameter(v.clone()) for v in values], [torch.nn.Parameter(v.clone()) for v in values]


def loss_of(params: list[torch.nn.Parameter], t: int) -> torch.Tensor:
    a, b, _unused = params
    return (a.sin() * (t + 1)).sum() + (b**3).sum()


OPTIONS = [
    {},
    {"weight_decay": 0.1},
    {"maximize": True},
    {"betas": (0.0, 0.9), "eps": 1e-6, "lr": 3e-3},
]


def test_a_roles_update_takes_the_same_steps_as_zero_grad_backward_step():
    ours, theirs = twin_params(1)
    role, opt_theirs = TrainingRole("model", torch.optim.Adam(ours, fused=True)), torch.optim.Adam(theirs, fused=True)
    for t in range(4):
        norm = role.update(loss_of(ours, t))
        opt_theirs.zero_grad(set_to_none=True)
        loss_of(theirs, t).backward()
        for p in theirs:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        expected = torch.nn.utils.get_total_norm([p.grad for p in theirs])
        opt_theirs.step()
        assert torch.equal(norm, expected)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_total_norm_and_the_logged_mean_equal_torchs():
    grads = [torch.randn(3, 4), torch.randn(7), torch.zeros(2)]
    assert torch.equal(total_norm(grads), torch.nn.utils.get_total_norm(grads))
    p = torch.nn.Parameter(torch.ones(3))
    role = TrainingRole("model", torch.optim.SGD([p], lr=0.1))
    assert role.take_mean_grad_norm() is None  # no update yet
    norms = [float(role.update((p * k).sum())) for k in (1.0, 2.0, 4.0)]
    assert role.take_mean_grad_norm() == pytest.approx(sum(norms) / 3, rel=1e-6)
    assert role.take_mean_grad_norm() is None  # reset after reading


def test_nothing_is_stored_on_a_torch_optimizer():
    """A role keeps its clipping, schedule, scaler, average and gradient statistics itself: after a
    few BiSM steps (clipped, scheduled, averaged) each role's optimizer holds no attribute that
    torch's own optimizer, stepped the same number of times, lacks."""
    from eblvm_core.build import build
    from eblvm_core.recipe import load_recipe
    from tests.support import RECIPES

    overrides = ["optim.model.max_grad_norm=1.0", 'optim.model.schedule.kind="cosine"', "optim.posterior.ema=0.9"]
    built = build(load_recipe(RECIPES / "grbm_bissm.toml", [*overrides, "~eval"]), torch.device("cpu"))
    batch = built.parts.data.tensor("train", 32)
    for step in range(3):
        for role in built.roles.values():
            role.set_lr(step, 10, 10)
        built.parts.estimator.step(batch)
    for name, role in built.roles.items():
        params = [torch.nn.Parameter(p.detach().clone()) for p in role.params]
        reference = type(role.optimizer)(params, **role.optimizer.defaults)
        for _ in range(3):
            for p in params:
                p.grad = torch.ones_like(p)
            reference.step()
        extra = set(vars(role.optimizer)) - set(vars(reference))
        assert not extra, f"role '{name}': attributes stored on its torch optimizer: {sorted(extra)}"
