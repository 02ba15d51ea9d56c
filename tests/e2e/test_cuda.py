"""The same code on a CUDA device: exact quantities agree with the CPU, and every GRBM recipe
trains and evaluates there. Skipped on machines without CUDA (CI has none)."""

from __future__ import annotations

import math

import pytest
import torch

from eblvm.testing import tiny_grbm_setup
from eblvm_core.checkpoint import last_checkpoint
from eblvm_core.contracts import exact_score
from tests.plugins.images.test_images import frey_images, write_frey
from tests.support import RECIPES
from tests.support import session_run as run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

CUDA = torch.device("cuda")


@pytest.mark.parametrize("coupling", ["scaled", "plain"])
def test_grbm_quantities_agree_between_cpu_and_cuda(coupling):
    from eblvm_bism import modified_score

    setup = tiny_grbm_setup(d=3, m=4, n=32, coupling=coupling)
    model, posterior, v = setup.model, setup.posterior, setup.v
    on_cpu = [model.free_energy(v), model.log_partition(), exact_score(model, v, create_graph=False)]
    torch.manual_seed(0)
    relaxed_cpu = modified_score(model, posterior)(v)
    model.to(CUDA), posterior.to(CUDA)
    v = v.to(CUDA)
    on_gpu = [model.free_energy(v), model.log_partition(), exact_score(model, v, create_graph=False)]
    for a, b in zip(on_cpu, on_gpu):
        torch.testing.assert_close(b.cpu(), a.detach(), rtol=1e-10, atol=1e-10)
    # with q the exact posterior the modified score is the marginal score whatever h is drawn
    torch.testing.assert_close(
        modified_score(model, posterior)(v).detach().cpu(), relaxed_cpu.detach(), rtol=1e-9, atol=1e-9
    )


@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPES.glob("grbm_*.toml")))
def test_every_grbm_recipe_trains_and_evaluates_on_cuda(recipe, tmp_path):
    overrides = ["run.steps=30", "run.log_every=10", "run.eval_every=30"]
    run_dir, results = run(RECIPES / recipe, overrides, device="cuda", out=tmp_path, echo=lambda _: None)
    assert results and all(math.isfinite(value) for value in results.values()), results
    assert last_checkpoint(run_dir).exists()


@pytest.mark.parametrize("recipe", ["freyface_dsm.toml", "freyface_bidsm.toml", "freyface_vagesdsm.toml"])
def test_frey_face_recipes_train_on_cuda(recipe, tmp_path):
    write_frey(tmp_path, frey_images(1965))
    overrides = [
        "run.steps=20",
        "run.log_every=10",
        f'data.root="{tmp_path}"',
        "eval.1.n_chains=200",
        "eval.1.n_temps=200",
    ]
    _, results = run(RECIPES / recipe, overrides, device="cuda", out=tmp_path / "runs", echo=lambda _: None)
    assert all(math.isfinite(value) for value in results.values()), results


def test_a_cuda_index_and_bf16_autocast_on_cuda(tmp_path):
    """`cuda:0` is accepted, and the bf16 DSM loss and gradient of a conv energy agree with fp32 on CUDA too."""
    from eblvm.testing import make
    from tests.core.test_precision import TOLERANCE, ConvEnergy, loss_and_gradient, relative

    torch.manual_seed(0)
    model, objective = ConvEnergy().to(CUDA), make("objectives", "dsm", sigma=0.1)
    x, context = objective.points(torch.rand(64, 1, 8, 8, device=CUDA))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss16 = objective.loss(lambda y: exact_score(model, y), x, context).mean()
    loss32, grad32 = loss_and_gradient(model, objective, x, context, bf16=False)
    params = list(model.parameters())
    grads = torch.autograd.grad(loss16, params, allow_unused=True)
    grad16 = torch.cat([(torch.zeros_like(p) if g is None else g).flatten() for p, g in zip(params, grads)])
    target = 0.5 * ((context / 0.1) ** 2).flatten(1).sum(1).mean()
    assert abs(float(loss16 - loss32)) < TOLERANCE * abs(float(loss32 - target))
    assert relative(grad16, grad32) < TOLERANCE
    overrides = ["run.steps=20", "run.log_every=10", 'run.device="cuda:0"', "run.eval_every=0"]
    run_dir, results = run(RECIPES / "grbm_dsm.toml", overrides, out=tmp_path, echo=lambda _: None)
    assert all(math.isfinite(value) for value in results.values())


def test_image_folder_batches_reach_cuda_through_pinned_memory(tmp_path):
    from eblvm_core.data import Batches
    from tests.core.test_data import folder_data, write_images

    write_images(tmp_path / "train", 8)
    write_images(tmp_path / "test", 2)
    data = folder_data(tmp_path, workers=2)
    on_gpu = Batches(data, 4, 0, CUDA, torch.float32)
    on_cpu = Batches(data, 4, 0, torch.device("cpu"), torch.float32)
    for _ in range(3):
        a, b = on_gpu.next(), on_cpu.next()
        assert a.device.type == "cuda" and a.shape == (4, 3, 6, 5)
        torch.testing.assert_close(a.cpu(), b, rtol=0, atol=1e-7)
    augmented = Batches(folder_data(tmp_path, workers=2, flip=True, dequantize=True), 4, 0, CUDA, torch.float32).next()
    assert augmented.device.type == "cuda" and 0 <= float(augmented.min()) and float(augmented.max()) <= 1


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_three_roles_train_on_cuda(tmp_path, monkeypatch, precision):
    from eblvm_core import plugins
    from tests.core.test_roles import RECIPE

    monkeypatch.setenv("EBLVM_PLUGIN_MODULES", "tests.support.three_roles")
    monkeypatch.setattr(plugins, "_loaded", None)
    plugins.load(force=True)
    recipe = tmp_path / "roles.toml"
    recipe.write_text(RECIPE)
    _, results = run(
        recipe, [f'run.precision="{precision}"'], device="cuda", out=tmp_path / "runs", echo=lambda _: None
    )
    assert math.isfinite(results["eval/generator-norm/norm"])


@pytest.mark.parametrize("recipe", ["digits_bidvl.toml", "digits_bimdsm.toml"])
def test_the_digits_recipes_train_on_cuda(recipe, tmp_path):
    overrides = ["run.steps=20", "run.log_every=10", "run.eval_every=0"]
    _, results = run(RECIPES / recipe, overrides, device="cuda", out=tmp_path, echo=lambda _: None)
    assert all(math.isfinite(value) for value in results.values()), results


@pytest.mark.parametrize("recipe", ["grbm_bissm.toml", "grbm_pcd.toml"])
def test_a_run_resumed_on_cuda_ends_where_the_uninterrupted_run_does(recipe, tmp_path):
    """The checkpoint is read onto the GPU; its RNG states must still reach the CPU generators,
    and the resumed run must end bit-identical to the run that never stopped."""
    from eblvm_core import checkpoint as ckpt

    quiet = lambda _: None  # noqa: E731
    common = ["run.log_every=10", "run.eval_every=40", "run.checkpoint_every=20"]
    straight, _ = run(RECIPES / recipe, [*common, "run.steps=40"], device="cuda", out=tmp_path / "a", echo=quiet)
    half, _ = run(RECIPES / recipe, [*common, "run.steps=20"], device="cuda", out=tmp_path / "b", echo=quiet)
    resumed, _ = run(None, ["run.steps=40"], device="cuda", resume=half, echo=quiet)
    a, b = ckpt.load(last_checkpoint(straight)), ckpt.load(last_checkpoint(resumed))
    assert b["step"] == 40
    for name, tensors in a["networks"].items():
        for key, value in tensors.items():
            assert torch.equal(b["networks"][name][key], value), (name, key)


def test_device_auto_trains_a_small_model_on_the_cpu_only_when_its_step_is_not_graph_replayed(tmp_path):
    import json

    quiet = lambda _: None  # noqa: E731
    graphed, _ = run(RECIPES / "grbm_bissm.toml", ["run.steps=5"], device="auto", out=tmp_path, echo=quiet)
    small, _ = run(
        RECIPES / "grbm_bism_implicit.toml",
        ["run.steps=5", "estimator.fixed_iterations=false"],
        device="auto",
        out=tmp_path,
        echo=quiet,
    )
    write_frey(tmp_path, frey_images(1965))
    large, _ = run(
        RECIPES / "freyface_dsm.toml",
        ["run.steps=5", f'data.root="{tmp_path}"', "eval.1.n_chains=50", "eval.1.n_temps=50"],
        device="auto",
        out=tmp_path,
        echo=quiet,
    )
    runs = (graphed, small, large)
    devices = [json.loads((d / "run.json").read_text())["sessions"][0]["device"] for d in runs]
    assert devices[0].startswith("cuda") and devices[1] == "cpu" and devices[2].startswith("cuda"), devices


@pytest.mark.parametrize(
    "recipe, overrides",
    [
        ("grbm_bissm.toml", []),
        ("grbm_bidsm.toml", ['estimator.unroll="adam"']),
        ("grbm_dsm.toml", []),
        ("grbm_ssm.toml", ['optim.model.kind="sgd"', "optim.model.lr=1e-3", "optim.model.momentum=0.9"]),
        ("grbm_cd.toml", []),
        ("grbm_pcd.toml", []),
        ("grbm_isksd.toml", []),
    ],
)
def test_a_graph_replayed_step_trains_as_the_eager_step_does(recipe, overrides, tmp_path):
    """100 steps from the same seed with the step replayed from a CUDA graph and launched eagerly
    end at the same parameters (float tolerance; the same kernels draw the same random numbers)."""
    from eblvm_core import checkpoint as ckpt

    ends, said = {}, {}
    for graph in (True, False):
        lines: list[str] = []
        common = [
            *overrides,
            "run.steps=100",
            "run.log_every=50",
            "run.checkpoint_every=100",
            f"run.cuda_graph={str(graph).lower()}",
        ]
        run_dir, _ = run(RECIPES / recipe, common, device="cuda", out=tmp_path / str(graph), echo=lines.append)
        ends[graph], said[graph] = ckpt.load(last_checkpoint(run_dir)), "\n".join(lines)
    assert "CUDA graph: the training step is captured" in said[True] and "eagerly" not in said[True], said[True]
    assert "CUDA graph: not used: [run] cuda_graph = false" in said[False]
    for name, tensors in ends[False]["networks"].items():
        for key, eager in tensors.items():
            graphed = ends[True]["networks"][name][key]
            print(recipe, name, key, "max |graph - eager| =", float((graphed - eager).abs().max()))
            torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-6)


def test_graphed_step_replays_the_eager_updates_and_random_draws_and_falls_back_on_a_new_shape():
    from eblvm_core.graphs import WARMUP_STEPS, GraphedStep
    from eblvm_core.roles import TrainingRole

    def trainer():
        p = torch.zeros(3, device=CUDA, requires_grad=True)
        role = TrainingRole("model", torch.optim.Adam([p], lr=0.1, fused=True))

        def step(batch):
            noise = torch.randn(3, device=CUDA)
            loss = ((p - batch[:3] - noise) ** 2).sum()
            role.update(loss)
            return {"loss": loss.detach(), "noise": noise.clone()}

        return p, role, step

    def offset() -> int:  # the default generator's Philox offset after a call
        torch.cuda.synchronize()
        return int(torch.cuda.default_generators[0].get_offset())

    batches = [torch.full((3,), float(i), device=CUDA) for i in range(12)] + [torch.ones(5, device=CUDA)] * 2
    torch.manual_seed(0)
    p_eager, _, eager = trainer()
    eager_calls = [(eager(b), offset()) for b in batches]
    torch.manual_seed(0)
    p_graph, role, step = trainer()
    told: list[str] = []
    graphed = GraphedStep(step, {"model": role}, told.append)
    graph_calls = []
    for i, b in enumerate(batches):
        metrics = graphed(b)
        graph_calls.append(({k: v.clone() for k, v in metrics.items()}, offset()))
        if i == WARMUP_STEPS + 1:
            assert graphed.graph is not None
    eager_draws, graph_draws = ([m["noise"] for m, _ in calls] for calls in (eager_calls, graph_calls))
    parted = [i for i, (e, g) in enumerate(zip(eager_draws, graph_draws)) if not torch.equal(e, g)]
    assert not parted, (
        f"draws part from call {parted[0]} (captured at call {WARMUP_STEPS}); offsets after each call: "
        f"eager {[o for _, o in eager_calls]}, graph {[o for _, o in graph_calls]}; the graph's draw at each "
        "parted call equals the eager draws of calls "
        f"{[[j for j, e in enumerate(eager_draws) if torch.equal(e, graph_draws[i])] for i in parted]}; "
        f"distinct graph draws: {len({tuple(g.tolist()) for g in graph_draws})} of {len(graph_draws)}"
    )
    losses_eager = [float(m["loss"]) for m, _ in eager_calls]
    assert [float(m["loss"]) for m, _ in graph_calls] == pytest.approx(losses_eager, rel=1e-6)
    torch.testing.assert_close(p_graph, p_eager)
    assert len(told) == 1 and "a batch of shape (5,)" in told[0] and graphed.graph is None


def test_a_step_returning_python_numbers_is_never_captured():
    from eblvm_core.graphs import GraphedStep
    from eblvm_core.roles import TrainingRole

    p = torch.zeros(3, device=CUDA, requires_grad=True)
    role = TrainingRole("model", torch.optim.Adam([p], lr=0.1, fused=True))

    def step(batch):
        loss = ((p - batch) ** 2).sum()
        role.update(loss)
        return {"loss": float(loss)}

    told: list[str] = []
    graphed = GraphedStep(step, {"model": role}, told.append)
    for _ in range(8):
        graphed(torch.ones(3, device=CUDA))
    assert graphed.graph is None and len(told) == 1 and "loss as Python numbers" in told[0]
    assert float(role._norms[0][1]) == 8  # every step counted, eagerly


# ---- scheduled rates and the deep steps in a CUDA graph ---------------------------------------------


def graph_and_eager_runs(recipe, overrides, tmp_path):
    """The same run from the same seed with the step replayed from a CUDA graph and launched
    eagerly: {graph: (last checkpoint, log lines, training rows of metrics.jsonl)}."""
    import json

    from eblvm_core import checkpoint as ckpt

    runs = {}
    for graph in (True, False):
        lines: list[str] = []
        options = [*overrides, f"run.cuda_graph={str(graph).lower()}"]
        run_dir, _ = run(RECIPES / recipe, options, device="cuda", out=tmp_path / str(graph), echo=lines.append)
        rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
        runs[graph] = (ckpt.load(last_checkpoint(run_dir)), "\n".join(lines), [r for r in rows if "train/loss" in r])
    return runs


def assert_bit_identical(runs, label):
    """Every network tensor of the graph-replayed run equals the eager run's, to the bit."""
    graphed, eager = runs[True][0]["networks"], runs[False][0]["networks"]
    differ = {}
    for name, tensors in eager.items():
        for key, value in tensors.items():
            if not torch.equal(graphed[name][key], value):
                differ[f"{name}.{key}"] = float((graphed[name][key].double() - value.double()).abs().max())
    assert not differ, f"{label}: graph and eager runs differ (max abs difference per tensor): {differ}"


SCHEDULED = {
    "grbm_bissm, cosine on both roles": (
        "grbm_bissm.toml",
        [
            'optim.model.schedule.kind="cosine"',
            "optim.model.schedule.warmup_steps=10",
            "optim.model.schedule.min_lr=1e-5",
            'optim.posterior.schedule.kind="cosine"',
        ],
    ),
    "grbm_bidsm, Adam unroll reading the posterior's cosine rate": (
        "grbm_bidsm.toml",
        ['estimator.unroll="adam"', 'optim.posterior.schedule.kind="cosine"'],
    ),
    "grbm_ssm, fused SGD with momentum, cosine": (
        "grbm_ssm.toml",
        [
            'optim.model.kind="sgd"',
            "optim.model.lr=1e-3",
            "optim.model.momentum=0.9",
            'optim.model.schedule.kind="cosine"',
        ],
    ),
    "grbm_dsm, exponential per step": (
        "grbm_dsm.toml",
        [
            'optim.model.schedule.kind="exponential"',
            "optim.model.schedule.gamma=0.97",
            'optim.model.schedule.every="step"',
        ],
    ),
}


@pytest.mark.parametrize("case", list(SCHEDULED))
def test_a_scheduled_run_replayed_from_a_cuda_graph_is_bit_identical_to_eager(case, tmp_path):
    """With a schedule the rate changes every step; the graph reads it from a device tensor that is
    updated in place before each replay. 100 steps end at the same bits as the eager run (whose
    scheduled rates are the same float32 values, given as numbers), and both log the same rates."""
    from eblvm_core.roles import device_rate

    recipe, overrides = SCHEDULED[case]
    common = [*overrides, "run.steps=100", "run.log_every=10", "run.checkpoint_every=100", "run.eval_every=0"]
    runs = graph_and_eager_runs(recipe, common, tmp_path)
    said = runs[True][1]
    assert "CUDA graph: the training step is captured" in said and "eagerly" not in said, said
    assert "read from device tensors" in said, said
    assert "CUDA graph: not used: [run] cuda_graph = false" in runs[False][1]
    assert_bit_identical(runs, case)
    rates = [{k: v for k, v in row.items() if k.startswith("lr/")} for row in runs[True][2]]
    assert rates == [{k: v for k, v in row.items() if k.startswith("lr/")} for row in runs[False][2]]
    moving = [k for k in rates[0] if len({r[k] for r in rates}) > 5]  # the scheduled roles' rates moved
    assert moving, rates
    assert all(r[k] == device_rate(r[k]) for r in rates for k in moving)  # float32 values, as the tensors hold
    if "sgd" in case.lower():
        assert runs[True][0]["roles"]["model"]["optimizer"]["param_groups"][0][
            "fused"
        ]  # the factory's fused SGD on CUDA


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_graphed_step_reads_each_steps_rate_from_its_tensor(kind):
    """GraphedStep with RateTensors: every replay uses the rate written before it; the parameters
    equal those of eager steps given the same (float32) rates as numbers, bit for bit."""
    from eblvm_core.graphs import WARMUP_STEPS, GraphedStep
    from eblvm_core.optim import RateTensors
    from eblvm_core.roles import TrainingRole, device_rate

    def trainer():
        p = torch.zeros(5, device=CUDA, requires_grad=True)
        if kind == "adam":
            opt = torch.optim.Adam([p], lr=0.1, fused=True)
        else:
            opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, fused=True)
        role = TrainingRole("model", opt)

        def step(batch):
            loss = ((p - batch - torch.randn(5, device=CUDA)) ** 2).sum()
            role.update(loss)
            return {"loss": loss.detach()}

        return p, role, step

    rates = [device_rate(0.1 * 0.8**t) for t in range(16)]
    batches = [torch.full((5,), float(t), device=CUDA) for t in range(16)]
    torch.manual_seed(0)
    p_eager, role, eager = trainer()
    for rate, batch in zip(rates, batches):
        role.optimizer.param_groups[0]["lr"] = rate
        eager(batch)
    torch.manual_seed(0)
    p_graph, role, step = trainer()
    opt = role.optimizer
    graphed = GraphedStep(step, {"model": role}, print, RateTensors([opt]))
    for t, (rate, batch) in enumerate(zip(rates, batches)):
        opt.param_groups[0]["lr"] = rate
        graphed(batch)
        assert isinstance(opt.param_groups[0]["lr"], float)  # the number again between steps
        if t == WARMUP_STEPS:
            assert graphed.graph is not None
    assert graphed.refusal is None and graphed.graph is not None
    assert torch.equal(p_graph, p_eager)


DEEP_GRAPHED = {  # the deep steps on the digits recipes, with rates that move every step
    "BiMDSM, channels-last, cosine": ("digits_bimdsm.toml", ["model.channels_last=true"]),
    "MDSM, exact score, cosine": (
        "digits_bimdsm.toml",
        ['model.kind="resnet-ebm"', "~model.latent_dim", "~posterior", "~divergence", 'estimator.kind="exact-score"']
        + ["~estimator.inner_steps", "~estimator.unroll_steps", "~optim.posterior"],
    ),
    "BiDVL, exponential per step": (
        "digits_bidvl.toml",
        [f'optim.{role}.schedule.every="step"' for role in ("energy", "encoder", "generator")]
        + [f"optim.{role}.schedule.gamma=0.9" for role in ("energy", "encoder", "generator")],
    ),
    "BiMDSM, bf16, cosine": ("digits_bimdsm.toml", ['run.precision="bf16"']),
    "MDSM, exact score, bf16, cosine": (
        "digits_bimdsm.toml",
        ['model.kind="resnet-ebm"', "~model.latent_dim", "~posterior", "~divergence", 'estimator.kind="exact-score"']
        + ["~estimator.inner_steps", "~estimator.unroll_steps", "~optim.posterior", 'run.precision="bf16"'],
    ),
    "VaGES-MDSM, 5 Langevin steps on h, cosine": (
        "digits_bimdsm.toml",
        ['estimator.kind="vages"', "~estimator.unroll_steps", "estimator.n_samples=2", "estimator.langevin_steps=5"]
        + ['optim.posterior.schedule.kind="cosine"'],
    ),
}


@pytest.mark.parametrize("case", list(DEEP_GRAPHED))
def test_the_deep_steps_replayed_from_a_cuda_graph_train_as_the_eager_steps(case, tmp_path, monkeypatch):
    """BiMDSM, the exact-score MDSM EBM, BiDVL and VaGES-MDSM are captured (3 eager steps, the
    capture, 8 replays) and end at the eager run's bits. cuDNN is made deterministic for the
    comparison: its default algorithms may reduce in a different order from run to run, which
    would part any two runs, graph or not (if this fails by rounding-sized differences, check that
    first)."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    recipe, overrides = DEEP_GRAPHED[case]
    common = [*overrides, "~eval", "run.steps=12", "run.log_every=6", "run.checkpoint_every=12"]
    runs = graph_and_eager_runs(recipe, common, tmp_path)
    said = runs[True][1]
    assert "CUDA graph: the training step is captured" in said and "eagerly" not in said, said
    assert_bit_identical(runs, case)
    losses = [[row["train/loss"] for row in runs[graph][2]] for graph in (True, False)]
    assert losses[0] == losses[1] and all(math.isfinite(v) for v in losses[0])


@pytest.mark.parametrize("case", ["BiMDSM", "VaGES-MDSM", "BiDVL"])
def test_bf16_deep_steps_agree_with_fp32_on_cuda(case):
    """The CPU test's comparison (tests/core/test_precision.py: every gradient a step hands to its
    optimizers, and its losses) under CUDA autocast, with the same tolerances. The fp32 reference
    itself runs its convolutions in TF32 (PyTorch's default on the GPU)."""
    from tests.core.test_precision import check_bf16_step

    check_bf16_step(case, CUDA)


@pytest.mark.parametrize(
    "recipe, overrides",
    [
        ("grbm_bissm.toml", ['optim.model.schedule.kind="cosine"']),
        ("digits_bidvl.toml", ["~eval"]),  # 14 steps an epoch: the 15th batch starts a new epoch's order
        ("digits_bimdsm.toml", ["~eval"]),
    ],
)
def test_the_loop_reads_nothing_from_the_gpu_between_log_steps(recipe, overrides, tmp_path, monkeypatch):
    """From the 6th batch to the 25th of a 30-step run that logs, checks and saves at step 30 only,
    torch raises on any operation that waits for the GPU (``set_sync_debug_mode("error")``): the
    replayed step, its rate tensors, the next batch, the metric sums and the NaN guard's sentinel
    are all launched without reading the device."""
    from eblvm_core.data import Batches

    real_next, calls = Batches.next, [0]

    def next_batch(self):
        calls[0] += 1
        torch.cuda.set_sync_debug_mode("error" if 6 <= calls[0] < 26 else "default")
        return real_next(self)

    monkeypatch.setattr(Batches, "next", next_batch)
    options = [*overrides, "run.steps=30", "run.log_every=30", "run.checkpoint_every=30", "run.eval_every=0"]
    try:
        lines: list[str] = []
        run(RECIPES / recipe, options, device="cuda", out=tmp_path, echo=lines.append)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    said = "\n".join(lines)
    assert calls[0] == 30 and "CUDA graph: the training step is captured" in said and "eagerly" not in said, said
