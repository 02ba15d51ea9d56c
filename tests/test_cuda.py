"""The same code on a CUDA device: exact quantities agree with the CPU, and every GRBM recipe
trains and evaluates there. Skipped on machines without CUDA (CI has none)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from eblvm_core.checkpoint import last_checkpoint
from eblvm_core.contracts import exact_score
from eblvm_core.session import run
from eblvm_core.testing import tiny_grbm_setup
from tests.test_images import frey_images, write_frey

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
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
    from eblvm_core.testing import make
    from tests.test_precision import TOLERANCE, ConvEnergy, loss_and_gradient, relative

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
    from tests.test_data import folder_data, write_images

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
    from tests.test_roles import RECIPE

    monkeypatch.setenv("EBLVM_PLUGIN_MODULES", "tests.three_roles")
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
    small, _ = run(RECIPES / "grbm_bism_implicit.toml", ["run.steps=5"], device="auto", out=tmp_path, echo=quiet)
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
    from eblvm_core.optim import apply_update

    def trainer():
        p = torch.zeros(3, device=CUDA, requires_grad=True)
        opt = torch.optim.Adam([p], lr=0.1, fused=True)

        def step(batch):
            noise = torch.randn(3, device=CUDA)
            loss = ((p - batch[:3] - noise) ** 2).sum()
            apply_update(opt, loss)
            return {"loss": loss.detach()}

        return p, opt, step

    batches = [torch.full((3,), float(i), device=CUDA) for i in range(12)] + [torch.ones(5, device=CUDA)] * 2
    torch.manual_seed(0)
    p_eager, _, eager = trainer()
    losses_eager = [float(eager(b)["loss"]) for b in batches]
    torch.manual_seed(0)
    p_graph, opt, step = trainer()
    told: list[str] = []
    graphed = GraphedStep(step, {"model": opt}, told.append)
    losses_graph = []
    for i, b in enumerate(batches):
        losses_graph.append(float(graphed(b)["loss"]))
        if i == WARMUP_STEPS + 1:
            assert graphed.graph is not None
    assert losses_graph == pytest.approx(losses_eager, rel=1e-6)
    torch.testing.assert_close(p_graph, p_eager)
    assert len(told) == 1 and "a batch of shape (5,)" in told[0] and graphed.graph is None


def test_a_step_returning_python_numbers_is_never_captured():
    from eblvm_core.graphs import GraphedStep
    from eblvm_core.optim import apply_update

    p = torch.zeros(3, device=CUDA, requires_grad=True)
    opt = torch.optim.Adam([p], lr=0.1, fused=True)

    def step(batch):
        loss = ((p - batch) ** 2).sum()
        apply_update(opt, loss)
        return {"loss": float(loss)}

    told: list[str] = []
    graphed = GraphedStep(step, {"model": opt}, told.append)
    for _ in range(8):
        graphed(torch.ones(3, device=CUDA))
    assert graphed.graph is None and len(told) == 1 and "loss as Python numbers" in told[0]
    assert float(opt.grad_norm_stats[1]) == 8  # every step counted, eagerly
