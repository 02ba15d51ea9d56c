"""The same code on a CUDA device: exact quantities agree with the CPU, and every GRBM recipe
trains and evaluates there. Skipped on machines without CUDA (CI has none)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from eblvm_core.checkpoint import last_checkpoint
from eblvm_core.contracts import exact_score
from eblvm_core.testing import tiny_grbm_setup
from eblvm_core.trainer import run
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
