"""The compiled training step (``eblvm_core.compiled``) against the eager one, estimator by
estimator: from the same state, batch and seed the compiled step takes the same step (parameters,
optimizer moments, gradient statistics, metrics) to float tolerance and consumes the random
streams exactly as the eager step does; a compiled run resumes to the bit; ``[run] compile``'s
verdicts and refusals. Compiling takes seconds (inductor writes C++): every test that compiles is
slow, on small networks and batches."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

import eblvm
from eblvm_core import checkpoint as ckpt
from eblvm_core import inductor
from eblvm_core.compiled import COMPILING, CompiledStep, Refused, state_tensors
from eblvm_core.errors import ConfigError
from eblvm_core.plan import AUTO_COMPILE_STEPS, Launch, Machine, make_plan
from eblvm_core.recipe import load_recipe
from tests.support import RECIPES, metrics_rows, session_run

SMALL = ["run.seed=3", "run.batch_size=16", "data.n_train=64", "data.n_test=32", "~eval", "run.compile=false"]
DIGITS = ["~data.n_train", "data.n_test=1500", "run.batch_size=8"]  # the digits' options (no n_train)
CASES = {  # every estimator that compiles, at the checkerboard's size with short inner loops
    "bism-unrolled sgd, SSM": ("grbm_bissm.toml", ["estimator.inner_steps=1", "estimator.unroll_steps=2"]),
    "bism-unrolled natural, SSM": (
        "grbm_bissm.toml",
        ['estimator.unroll="natural"', "estimator.inner_steps=1", "estimator.unroll_steps=1"],
    ),
    "exact-score, SSM": ("grbm_ssm.toml", []),
    "exact-score, KSD": ("grbm_ksd.toml", []),
    "vages, DSM": ("grbm_vagesdsm.toml", ["estimator.inner_steps=1"]),
    "vages, KSD": ("grbm_vagesksd.toml", ["estimator.inner_steps=1"]),
    "is-score, KSD": ("grbm_isksd.toml", []),
    "cd": ("grbm_cd.toml", []),
    "pcd": ("grbm_pcd.toml", ["estimator.n_chains=16"]),
    "nce": ("grbm_nce.toml", []),
    "vnce": ("grbm_vnce.toml", ["estimator.inner_steps=1", "estimator.n_importance=2"]),
    "bism-implicit, CG of fixed length": (
        "grbm_bism_implicit.toml",
        [
            "estimator.inner_steps=1",
            'estimator.solver="cg"',
            "estimator.solver_steps=3",
            "estimator.fixed_iterations=true",
        ],
    ),
    "bism-implicit, Neumann of fixed length": (
        "grbm_bism_implicit.toml",
        ["estimator.inner_steps=1", "estimator.solver_steps=3", "estimator.fixed_iterations=true"],
    ),
    "bism-implicit, Fisher blocks": (
        "grbm_bism_implicit.toml",
        ["estimator.inner_steps=1", 'estimator.hessian="fisher-blocks"'],
    ),
    # convolutions, a conditioned energy, its K = 3 real steps cut into one part called three times
    "bism-unrolled, MDSM, deep EBLVM": (
        "digits_bimdsm.toml",
        [*DIGITS, "model.width=4", "posterior.channels=4", "model.latent_dim=4", "estimator.inner_steps=3"],
    ),
}
HALVED = [
    'optim.model.schedule.kind="exponential"',
    "optim.model.schedule.gamma=0.5",
    'optim.model.schedule.every="step"',
]
SCHEDULED = {  # a rate halved every step; with CASES, every estimator and optimizer
    "exact-score DSM, Adam": ("grbm_dsm.toml", HALVED),
    "exact-score DSM, SGD with momentum": (
        "grbm_dsm.toml",
        ['optim.model.kind="sgd"', "optim.model.momentum=0.9", *HALVED],
    ),
    "bism-unrolled adam, DSM": (
        "grbm_bidsm.toml",
        ["estimator.inner_steps=1", "estimator.unroll_steps=2", 'estimator.unroll="adam"', *HALVED],
    ),
}


def prepared(recipe: str, overrides: list[str]):
    return eblvm.prepare(RECIPES / recipe, overrides=[*SMALL, *overrides], device="cpu", echo=None)


def snapshot(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_the_compiled_step_takes_the_eager_step(case):
    """Two steps each way from the same state: parameters, Adam moments and counts, gradient
    statistics and metrics agree to float tolerance, and the random streams end where the eager
    steps leave them (the compiled step draws its random numbers eagerly, in the eager order)."""
    recipe, overrides = CASES[case]
    run = prepared(recipe, overrides)
    estimator = run.parts.estimator
    tensors = state_tensors(run.parts.networks(), run.roles, estimator)
    batches = [run.state.batches.next() for _ in range(2)]
    compiled = CompiledStep(estimator.step, tensors, run.state.batches.example(), estimator)
    start, rng = snapshot(tensors), ckpt.rng_state()
    eager_metrics = [estimator.step(b) for b in batches]
    eager, eager_rng = snapshot(tensors), torch.get_rng_state()
    with torch.no_grad():
        for t, value in zip(tensors, start):
            t.copy_(value)
    ckpt.set_rng_state(rng)
    compiled_metrics = [compiled(b) for b in batches]
    assert torch.equal(torch.get_rng_state(), eager_rng), "the compiled steps drew other random numbers"
    moved = [not torch.equal(a, b) for a, b in zip(eager, start)]
    assert sum(moved) >= 4, "the eager steps changed too little to compare"
    for a, b in zip(snapshot(tensors), eager):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    for got, want in zip(compiled_metrics, eager_metrics):
        assert got.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_trace_describes_its_values_in_one_fake_mode(monkeypatch):
    """Tracing real tensors, make_fx describes each value by a fake tensor, in a fake mode of its own
    (which records the Python stack) unless one is ambient: the step's trace shares one."""

    class Traced(Exception):
        pass

    def stop(graph):
        graphs.append(graph)
        raise Traced

    graphs: list[torch.fx.Graph] = []
    monkeypatch.setattr(inductor, "segments", stop)  # the trace only: no compile
    run = prepared("grbm_ssm.toml", [])
    estimator = run.parts.estimator
    tensors = state_tensors(run.parts.networks(), run.roles, estimator)
    with pytest.raises(Traced):
        CompiledStep(estimator.step, tensors, run.state.batches.example(), estimator)
    (graph,) = graphs
    values = [n.meta["val"] for n in graph.nodes if isinstance(n.meta.get("val"), FakeTensor)]
    assert len(values) > 20 and len({id(v.fake_mode) for v in values}) == 1


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SCHEDULED))
def test_a_scheduled_rate_is_an_input_of_the_compiled_step(case):
    """Three steps as the loop takes them, eagerly and compiled, from the same seed, with the rate
    halved every step: the parameters and the optimizers' moments agree to float tolerance, so each
    compiled step read its step's rate from the graph's input (a graph with the first rate built in
    takes the second step twice as long, the third four times), and the random stream ends where the
    eager steps leave it. The differentiable Adam of the unrolled steps reads the rate too."""
    recipe, overrides = SCHEDULED[case]
    eager = prepared(recipe, overrides)
    start = snapshot(list(eager.parts.networks()["model"].parameters()))
    for _ in range(3):
        eager.step()
    eager_rng = torch.get_rng_state()
    compiled = prepared(recipe, [*overrides, "run.compile=true"])  # seeded anew: the same start and draws
    assert compiled.compiled is not None and compiled.compiled.rates is not None
    for _ in range(3):
        compiled.step()
    assert torch.equal(torch.get_rng_state(), eager_rng), "the compiled steps drew other random numbers"
    base = compiled.recipe.optim["model"].optimizer.config.lr
    assert compiled.roles["model"].lr == eager.roles["model"].lr == pytest.approx(0.25 * base)
    moved = sum(not torch.equal(b, before) for b, before in zip(eager.parts.networks()["model"].parameters(), start))
    assert moved >= 2
    states = [state_tensors(run.parts.networks(), run.roles, run.parts.estimator) for run in (compiled, eager)]
    assert len(states[0]) == len(states[1]) > len(start)  # the moments (and the posterior's state) too
    for a, b in zip(*states):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_a_compiled_run_resumes_to_the_bit_and_records_how_it_stepped(tmp_path):
    """60 compiled steps straight and 30 + 30 with a resume between end at the same bits: every
    step of both is a call of the compiled graph, the random draws included. run.json says so."""
    common = ["run.seed=5", "run.compile=true", "run.log_every=10", "run.checkpoint_every=30", "~eval"]
    common += CASES["bism-unrolled sgd, SSM"][1] + ["run.batch_size=16"]  # its graph: compiled once in a session
    recipe = RECIPES / "grbm_bissm.toml"
    straight, _ = session_run(recipe, [*common, "run.steps=60"], out=tmp_path / "a", echo=lambda _line: None)
    half, _ = session_run(recipe, [*common, "run.steps=30"], out=tmp_path / "b", echo=lambda _line: None)
    lines: list[str] = []
    session_run(None, ["run.steps=60"], resume=half, echo=lines.append)
    compiling = lines.index(COMPILING)  # said before the trace, so the console says what the wait is for
    traced = [line for line in lines[compiling:] if line.startswith("compile: the training step is traced into ")]
    assert len(traced) == 1 and " and read from the compile cache (" in traced[0], lines  # the runs above compiled it
    a, b = ckpt.load(ckpt.last_checkpoint(straight)), ckpt.load(ckpt.last_checkpoint(half))
    for name, tensors in a["networks"].items():
        for key, value in tensors.items():
            assert torch.equal(value, b["networks"][name][key]), f"{name}.{key}"
    assert torch.equal(a["rng"]["torch"], b["rng"]["torch"])

    def losses(run_dir):
        return [row["train/loss"] for row in metrics_rows(run_dir) if "train/loss" in row]

    assert losses(straight) == losses(half) and len(losses(half)) == 6
    sessions = json.loads((half / "run.json").read_text())["sessions"]
    assert [s["training_step"] for s in sessions] == ["compiled", "compiled"]


@pytest.mark.slow
def test_a_compiled_run_that_diverges_stops_with_its_last_good_checkpoint(tmp_path):
    """The NaN guard sees a compiled step's loss as an eager one's: a rate that blows the model up
    (SGD at 30) stops the run (exit 3's error) at the step whose parameters left the finite
    numbers, naming the checkpoint of the step before, whose parameters are finite."""
    from eblvm_core.errors import TrainingDiverged

    # the scheduled SGD case's graph (its rate an input, here held constant): compiled once a session
    recipe, overrides = SCHEDULED["exact-score DSM, SGD with momentum"]
    options = [*SMALL, *overrides, "optim.model.schedule.gamma=1.0", "optim.model.lr=30", "run.compile=true"]
    options += ["run.steps=200", "run.log_every=1", "run.checkpoint_every=1"]
    with pytest.raises(TrainingDiverged, match="not finite|non-finite") as info:
        session_run(RECIPES / recipe, options, out=tmp_path, echo=lambda _line: None)
    named = re.search(r"last good checkpoint: (\S+) \(step (\d+)", str(info.value))
    assert named, str(info.value)
    checkpoint = Path(named.group(1))
    state = ckpt.load(checkpoint)
    assert state["step"] == int(named.group(2)) >= 1
    assert all(torch.isfinite(t).all() for t in state["networks"]["model"].values())
    sessions = json.loads((checkpoint.parent.parent / "run.json").read_text())["sessions"]
    assert [s["training_step"] for s in sessions] == ["compiled"]


def plan_of(recipe: str, overrides: list[str] = ()):
    spec = load_recipe(RECIPES / recipe, list(overrides))
    return make_plan(spec, lambda: eblvm_core_sizes(spec), Machine(0, False), Launch())


def eblvm_core_sizes(spec):
    from eblvm_core.build import measure

    return measure(spec)


@pytest.mark.parametrize(
    "recipe, overrides, why",
    [
        ("grbm_bissm.toml", [], None),  # 20,000 steps of a small model: compiled
        ("grbm_bissm.toml", [f"run.steps={AUTO_COMPILE_STEPS - 1}"], "too few to repay compiling"),
        ("grbm_bissm.toml", ["run.compile=false"], "[run] compile = false"),
        ("grbm_bism_implicit.toml", ["estimator.fixed_iterations=false"], "stop at a tolerance read on the host"),
        ("grbm_bism_implicit.toml", [], None),  # its solves run solver_steps iterations (fixed_iterations)
        ("grbm_bism_implicit.toml", ['estimator.hessian="fisher-blocks"'], None),
        ("grbm_nce.toml", [], None),
        ("grbm_vnce.toml", [], None),
        ("grbm_bissm.toml", ['run.precision="bf16"'], "precision bf16 is not traced"),
        ("grbm_bissm.toml", ['optim.model.schedule.kind="cosine"'], None),
        ("digits_bimdsm.toml", [], None),  # a scheduled rate; its conv step compiles in a minute and saves more
    ],
)
def test_auto_compiles_where_the_step_compiles_and_the_run_repays_it(recipe, overrides, why):
    plan = plan_of(recipe, overrides)
    assert plan.compile == why if why is None else why in plan.compile, plan.compile


def test_auto_keeps_large_networks_eager():
    plan = plan_of("grbm_bissm.toml", ["model.n_hidden=400000", "run.steps=20000"])
    assert "trainable parameters: the step is mostly matrix products" in plan.compile


def test_compile_true_on_a_step_that_cannot_compile_is_one_line_naming_run_compile(cli, write_recipe, tmp_path):
    recipe = write_recipe((RECIPES / "grbm_bism_implicit.toml").read_text())
    tolerance = ["-o", "run.compile=true", "-o", "estimator.fixed_iterations=false"]
    for command in (["validate", recipe, *tolerance], ["run", recipe, *tolerance, "--out", tmp_path / "runs"]):
        result = cli(command)
        assert result.exit_code == 2, result.output
        assert "[run] compile: true, but the step cannot be compiled: its conjugate-gradient" in result.output
    assert not (tmp_path / "runs").exists()
    with pytest.raises(ConfigError, match="compile"):
        plan_of("grbm_bism_implicit.toml", ["run.compile=true", "estimator.fixed_iterations=false"])


def test_a_step_that_fails_to_compile_trains_eagerly_under_auto_and_stops_under_true(tmp_path, monkeypatch):
    """No C++ compiler, an operation inductor cannot lower...: under auto one warning line and the
    eager step; under true one error line and no run directory."""
    import eblvm_core.compiled as compiled_module

    def fail(self, *args, **kwargs):
        raise Refused("compiling failed (CppCompileError: no C++ compiler)")

    monkeypatch.setattr(compiled_module.CompiledStep, "__init__", fail)
    said: list[str] = []
    auto = eblvm.prepare(
        RECIPES / "grbm_dsm.toml", overrides=[f"run.steps={AUTO_COMPILE_STEPS}", "~eval"], echo=said.append
    )
    assert auto.plan.compile is None and auto.compiled is None
    assert said == [COMPILING, "warning: compile: eager step: compiling failed (CppCompileError: no C++ compiler)"]
    assert set(auto.step()) == {"loss"}  # the eager step
    with pytest.raises(ConfigError, match=r"\[run\] compile: true, but the step cannot be compiled: compiling failed"):
        session_run(
            RECIPES / "grbm_dsm.toml",
            ["run.steps=20", "run.compile=true", "~eval"],
            out=tmp_path / "true",
            echo=lambda _line: None,
        )
    assert not (tmp_path / "true").exists()
