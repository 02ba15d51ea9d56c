"""Scheduled learning rates in device tensors (``optim.RateTensors``), what a training step captured
in a CUDA graph reads: on the CPU, a run whose optimizers read the rate from a tensor updated in
place before every step takes the same steps, bit for bit, as the run given the rate as a number,
over a cosine schedule, for fused Adam and for SGD with momentum. The number is the schedule's rate
rounded to float32 (``optim.device_rate``), as the trainer gives it on a CUDA device, where rate
tensors are used: a float32 tensor is what the fused kernels read, and fused Adam computes with the
rate in double, so the unrounded number steps differently (shown below). A tensor that is not
updated (what a graph that baked the rate in would do) is told apart. The replay itself needs a
GPU (tests/e2e/test_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from eblvm_core.build import build
from eblvm_core.checkpoint import seed_everything
from eblvm_core.graphs import scheduled_rates
from eblvm_core.optim import Cosine, CosineConfig, RateTensors
from eblvm_core.recipe import load_recipe
from eblvm_core.roles import TrainingRole, device_rate
from tests.support import RECIPES

STEPS = 40
SCHEDULE = Cosine(CosineConfig(warmup_steps=5, min_lr=1e-5))


def make(kind: str) -> tuple[list[torch.nn.Parameter], TrainingRole]:
    """Two parameter tensors (in two param groups, the second at twice the rate) and a role stepping
    them on SCHEDULE.
    1,040 numbers: a rate and its float32 rounding part an Adam step in a few percent of the numbers,
    so the control below needs hundreds of them on any CPU (28 parted none on one)."""
    gen = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(64, 16, generator=gen)),
        torch.nn.Parameter(torch.randn(16, generator=gen)),
    ]
    groups = [{"params": params[:1]}, {"params": params[1:], "lr": 2 * (3e-3 if kind == "adam" else 3e-2)}]
    if kind == "adam":
        optimizer = torch.optim.Adam(groups, lr=3e-3, betas=(0.9, 0.95), weight_decay=1e-4, fused=True)
    else:
        optimizer = torch.optim.SGD(groups, lr=3e-2, momentum=0.9, weight_decay=1e-4)
    return params, TrainingRole("model", optimizer, SCHEDULE)


def loss_of(params: list[torch.nn.Parameter], t: int) -> torch.Tensor:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(100 + t))
    return ((x @ params[0] + params[1]).sin() ** 2).sum()


def train(kind: str, rates: str) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer, list[float]]:
    """STEPS steps on the cosine schedule. ``rates``: "float" (the number in the group, rounded as
    the trainer rounds it on CUDA), "unrounded" (the schedule's number itself, as on the CPU),
    "tensor" (RateTensors written before each step and installed during it, as a captured step
    reads them) or "stale" (the tensor written once, at the first step's rate)."""
    params, role = make(kind)
    optimizer = role.optimizer
    tensors = RateTensors([optimizer]) if rates in ("tensor", "stale") else None
    seen = []
    for t in range(STEPS):
        role.set_lr(t, STEPS, 10, device_rates=rates != "unrounded")
        if tensors is None:
            role.update(loss_of(params, t))
            continue
        if rates == "tensor" or t == 0:
            tensors.write()
        with tensors.installed():
            assert all(group["lr"] is tensor for (group, tensor) in tensors.slots)
            role.update(loss_of(params, t))
        assert all(isinstance(group["lr"], float) for group in optimizer.param_groups)
        seen.append(float(tensors.slots[0][1]))
    return params, optimizer, seen


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_a_rate_tensor_updated_in_place_steps_as_the_float_rate(kind):
    floats, opt_f, _ = train(kind, "float")
    tensors, opt_t, seen = train(kind, "tensor")
    for a, b in zip(floats, tensors):
        assert torch.equal(a, b)
    for a, b in zip(floats, tensors):
        state_f, state_t = opt_f.state[a], opt_t.state[b]
        assert state_f.keys() == state_t.keys()
        assert all(torch.equal(state_f[k], state_t[k]) for k in state_f)
    base = 3e-3 if kind == "adam" else 3e-2
    assert seen == [device_rate(SCHEDULE.lr(base, t, STEPS, 10)) for t in range(STEPS)]  # the schedule's formula
    assert len(set(seen)) == STEPS - 1  # a new rate every step (the warm-up's last and the decay's first are
    # both the base rate): the comparison would see a stale one


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_a_rate_tensor_that_is_not_updated_is_told_apart(kind):
    """The control: the rate of the first step kept throughout (a graph that baked the number in)."""
    floats, _, _ = train(kind, "float")
    stale, _, _ = train(kind, "stale")
    assert not all(torch.equal(a, b) for a, b in zip(floats, stale))


def test_fused_adam_needs_the_rounded_rate_to_step_as_the_tensor_does():
    """Why the trainer rounds scheduled rates on CUDA: fused Adam computes lr/(1 − β1ᵗ) in double,
    so a float32 rate and the double it rounds step differently; torch's SGD casts the rate to the
    parameters' float32 either way."""
    tensors, _, _ = train("adam", "tensor")
    unrounded, _, _ = train("adam", "unrounded")
    assert not all(torch.equal(a, b) for a, b in zip(tensors, unrounded))
    tensors, _, _ = train("sgd", "tensor")
    unrounded, _, _ = train("sgd", "unrounded")
    assert all(torch.equal(a, b) for a, b in zip(tensors, unrounded))


def test_rate_tensors_are_written_in_place_and_only_when_the_rate_changes():
    _, role = make("adam")
    optimizer = role.optimizer
    rates = RateTensors([optimizer])
    tensors = [tensor for _, tensor in rates.slots]
    pointers = [t.data_ptr() for t in tensors]
    rates.write()
    versions = [t._version for t in tensors]
    rates.write()  # nothing changed: no kernel
    assert [t._version for t in tensors] == versions
    optimizer.param_groups[0]["lr"] = 1e-3
    rates.write()
    assert tensors[0]._version == versions[0] + 1 and tensors[1]._version == versions[1]
    assert [t.data_ptr() for t in tensors] == pointers  # the memory a captured graph reads
    assert all(t.dtype == torch.float32 and t.dim() == 0 for t in tensors)
    assert float(tensors[0]) == device_rate(1e-3) and float(tensors[1]) == device_rate(6e-3)


def test_device_rate_is_the_float32_a_rate_tensor_holds():
    for lr in (1e-3, 5e-5, 0.1, 1 / 3, 3e-4 * 0.998**17):
        rounded = device_rate(lr)
        assert rounded == float(torch.tensor(lr, dtype=torch.float32))
        assert device_rate(rounded) == rounded
    assert device_rate(0.1) != 0.1 and device_rate(0.5) == 0.5


def test_rate_tensors_cover_the_scheduled_roles_only():
    seed_everything(0)
    spec = load_recipe(RECIPES / "grbm_bissm.toml", ['optim.model.schedule.kind="cosine"'])
    built = build(spec, torch.device("cpu"))
    rates = scheduled_rates(built.roles)
    assert [group for group, _ in rates.slots] == built.roles["model"].optimizer.param_groups
    unscheduled = load_recipe(RECIPES / "grbm_bissm.toml")
    assert scheduled_rates(build(unscheduled, torch.device("cpu")).roles) is None


@pytest.mark.parametrize("device, rounded", [("cpu", False), ("cuda", True)])
def test_the_trainer_rounds_scheduled_rates_to_float32_on_cuda_only(device, rounded):
    """On a CUDA device a scheduled rate is the float32 its rate tensor holds, in replayed and eager
    steps alike; on the CPU the schedule's float itself (the CPU runs stay bit-identical). A
    constant rate is never rounded."""
    seed_everything(0)
    spec = load_recipe(RECIPES / "grbm_bissm.toml", ['optim.model.schedule.kind="cosine"', "optim.posterior.lr=0.1"])
    roles = build(spec, torch.device("cpu")).roles
    for role in roles.values():
        role.set_lr(7, spec.run.steps, 20, device_rates=device == "cuda")  # what the trainer does on the device
    model, posterior = roles["model"], roles["posterior"]
    exact = model.schedule.lr(model.base_lrs[0], 7, spec.run.steps, 20)
    assert model.lr == (device_rate(exact) if rounded else exact) and exact != device_rate(exact)
    assert posterior.lr == 0.1  # constant: the number the recipe gives
