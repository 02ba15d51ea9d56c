"""The plan (``eblvm_core.plan``): every decision about where and how a run computes, made once
from the recipe, the machine and the launch, before anything is placed. A machine with a GPU is
only described here (``Machine``): the plan decides without touching one."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from eblvm_core.build import build, measure
from eblvm_core.errors import ConfigError
from eblvm_core.plan import AUTO_GPU_MIN_PARAMETERS, SMALL_MODEL, Launch, Machine, Sizes, make_plan, numerics
from eblvm_core.recipe import load_recipe
from tests.support import RECIPES

A_GPU = Machine(cuda_devices=1, mps=False)
NO_GPU = Machine(cuda_devices=0, mps=False)


def plan_of(recipe: str, overrides: list[str] = (), machine: Machine = A_GPU, sizes: Sizes | None = None):
    spec = load_recipe(RECIPES / recipe, [*overrides, "~eval"])
    return make_plan(spec, lambda: sizes or measure(spec), machine, Launch())


def test_the_sizes_count_every_parameter_and_the_trainable_ones_apart():
    from eblvm.testing import tiny_grbm_setup

    parts = tiny_grbm_setup(d=2, m=4, n=4).parts
    total = sum(p.numel() for net in (parts.model, parts.posterior) for p in net.parameters())
    assert Sizes.of(parts.networks()) == Sizes(total, total)
    parts.posterior.requires_grad_(False)
    frozen = sum(p.numel() for p in parts.posterior.parameters())
    assert Sizes.of(parts.networks()) == Sizes(total, total - frozen)
    frey = tiny_grbm_setup(d=560, m=400, n=4).parts
    assert (
        Sizes.of(frey.networks()).trainable
        > AUTO_GPU_MIN_PARAMETERS
        > Sizes.of(tiny_grbm_setup(560, 20, 4).parts.networks()).trainable
    )


@pytest.mark.parametrize(
    "recipe, overrides, on_cpu",
    [
        ("grbm_bissm.toml", [], None),  # small, but its step is replayed from a CUDA graph
        ("grbm_bissm.toml", ["run.cuda_graph=false"], "[run] cuda_graph = false"),
        (
            "grbm_bism_implicit.toml",
            ["estimator.fixed_iterations=false"],
            "its conjugate-gradient and Neumann solves stop at a tolerance",
        ),
        ("grbm_nce.toml", [], None),  # its noise is drawn and scored without host reads
        ("grbm_bissm.toml", ['optim.model.schedule.kind="cosine"'], None),  # the rate is read from a device tensor
        # on a CUDA device optim.sgd is the fused kernel, which reads a scheduled rate from its tensor
        (
            "grbm_ssm.toml",
            ['optim.model.kind="sgd"', "optim.model.momentum=0.9", 'optim.model.schedule.kind="cosine"'],
            None,
        ),
    ],
)
def test_device_auto_keeps_a_small_model_on_the_cpu_only_when_its_step_cannot_be_graph_replayed(
    recipe, overrides, on_cpu
):
    plan = plan_of(recipe, [*overrides, 'run.device="auto"'])
    if on_cpu is None:
        assert plan.device == torch.device("cuda") and plan.device_note is None and plan.cuda_graph is None
        return
    assert plan.device == torch.device("cpu"), plan
    assert on_cpu in plan.device_note and "trainable parameters" in plan.device_note
    assert plan.precision.device_type == "cpu" and plan.threads == 1  # the CPU's own choices follow


def test_a_large_model_stays_on_the_gpu_and_a_named_device_is_kept():
    assert plan_of("grbm_nce.toml", sizes=Sizes(10**6, 10**6)).device == torch.device("cuda")
    assert plan_of("grbm_nce.toml", ['run.device="cuda"']).device == torch.device("cuda")  # only auto falls back
    assert plan_of("grbm_nce.toml", machine=NO_GPU).device == torch.device("cpu")


def test_the_sizes_are_measured_only_where_a_decision_needs_them():
    def refuse() -> Sizes:
        raise AssertionError("measured")

    spec = load_recipe(RECIPES / "grbm_bissm.toml", ['run.device="cuda"', "run.threads=2"])
    plan = make_plan(spec, refuse, A_GPU, Launch())
    assert plan.device == torch.device("cuda") and plan.threads == 2
    assert plan.lines() == []  # replayed: the CUDA graph's own line comes from graphs


@pytest.mark.parametrize(
    "size, threads, expected",
    [(SMALL_MODEL - 1, 0, 1), (SMALL_MODEL + 1, 0, None), (SMALL_MODEL - 1, 3, 3)],
)
def test_threads_are_chosen_by_model_size(size, threads, expected):
    """[run] threads = 0: one thread on a CPU below SMALL_MODEL parameters, torch's setting above
    it and on other devices; a positive value is used as it is."""
    plan = plan_of("grbm_bissm.toml", [f"run.threads={threads}"], NO_GPU, Sizes(size, size))
    assert plan.threads == expected
    assert plan_of("grbm_bissm.toml", ['run.device="cuda"', "run.threads=0"], A_GPU, Sizes(1, 1)).threads is None


def test_several_processes_take_the_gpu_of_their_local_rank():
    spec = load_recipe(RECIPES / "grbm_bissm.toml", ['run.device="cuda"'])
    plan = make_plan(spec, lambda: Sizes(1, 1), Machine(2, False), Launch(rank=3, world=4, local_rank=1))
    assert plan.device == torch.device("cuda", 1) and (plan.rank, plan.world) == (3, 4)
    assert "several processes" in plan.cuda_graph


@pytest.mark.parametrize(
    "device, machine, message",
    [
        ("cuda", NO_GPU, "cuda requested but no CUDA device is available"),
        ("cuda:1", A_GPU, "cuda:1 requested but this machine has 1 CUDA device(s)"),
        ("mps", NO_GPU, "mps requested but it is not available"),
    ],
)
def test_a_device_that_is_not_here_is_a_config_error_naming_run_device(device, machine, message):
    with pytest.raises(ConfigError, match="device") as info:
        plan_of("grbm_bissm.toml", [f'run.device="{device}"'], machine)
    assert message in str(info.value) and "[run] device" in str(info.value)


def test_cudnn_autotuning_and_flushed_subnormals_hold_inside_the_block_only():
    """[run] cudnn_benchmark turns cuDNN's timing on for a CUDA run's block and puts the previous
    setting back, also when the block fails; a CPU run flushes subnormals inside it."""
    assert torch.backends.cudnn.benchmark is False
    cuda = plan_of("grbm_bissm.toml", ['run.device="cuda"', "run.cudnn_benchmark=true"])
    cpu = plan_of("grbm_bissm.toml", ["run.cudnn_benchmark=true"], NO_GPU)
    assert cuda.cudnn_benchmark and not cpu.cudnn_benchmark
    assert cuda.lines()[0].startswith("cuDNN: convolution algorithms chosen by timing")
    threads = torch.get_num_threads()
    try:
        with pytest.raises(RuntimeError, match="fails"), numerics(cuda):
            assert torch.backends.cudnn.benchmark is True
            raise RuntimeError("a block that fails")
        assert torch.backends.cudnn.benchmark is False
        tiny = torch.tensor(1e-39)
        with numerics(cpu):
            assert float(tiny * 1.0) == 0.0
        assert float(tiny * 1.0) > 0
    finally:
        torch.set_num_threads(threads)


def test_measuring_the_sizes_leaves_every_random_stream_where_it_was():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    measure(load_recipe(RECIPES / "grbm_bissm.toml"))
    assert torch.equal(torch.get_rng_state(), before)


def test_a_run_that_falls_back_to_the_cpu_builds_once_there_and_says_why(write_recipe, tmp_path, monkeypatch):
    """With a GPU in view a small model whose step is not graph-safe (implicit BiSM, whose solves
    stop at a tolerance) trains on the CPU: the plan says so before anything is built, the one
    build is on the CPU, and the run says why."""
    import eblvm_core.plan as plan_module
    import eblvm_core.session as session_module
    from tests.support import session_run as run

    monkeypatch.setattr(plan_module.Machine, "here", classmethod(lambda cls: A_GPU))
    devices = []

    def counted(recipe, plan, **kwargs):
        devices.append(plan.device)
        return build(recipe, plan, **kwargs)

    monkeypatch.setattr(session_module, "build", counted)
    recipe = write_recipe((RECIPES / "grbm_bism_implicit.toml").read_text())
    said: list[str] = []
    run_dir, _ = run(
        recipe,
        ["run.steps=20", "~eval", 'run.device="auto"', "estimator.fixed_iterations=false"],
        out=tmp_path / "runs",
        echo=said.append,
    )
    assert devices == [torch.device("cpu")]
    assert any(line.startswith("device auto:") and "training on the CPU" in line for line in said), said
    assert "device cpu" in next(line for line in said if line.startswith("run directory:"))
    assert json.loads((run_dir / "run.json").read_text())["sessions"][0]["device"] == "cpu"


def test_a_network_is_placed_with_the_plans_device_and_dtype():
    spec = load_recipe(RECIPES / "grbm_bissm.toml", ['run.dtype="float64"', "~eval"])
    built = build(spec, "cpu")
    assert built.plan.device == torch.device("cpu")
    assert all(p.dtype == torch.float64 for net in built.parts.networks().values() for p in net.parameters())
    assert isinstance(built.parts.model, nn.Module)
