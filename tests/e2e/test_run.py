"""End-to-end runs through the CLI: run directory, metrics, TensorBoard, checkpoints, resume, NaN."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from eblvm_core import checkpoint as ckpt
from tests.support import RECIPES, ROOT, SMALL_RECIPE, kill_run_when, poison_at

WITH_PLOT = SMALL_RECIPE + '\n[[eval]]\nkind = "density-plot"\ngrid = 40\n'


def only_run_dir(out: Path) -> Path:
    (name_dir,) = list(out.iterdir())
    (run_dir,) = list(name_dir.iterdir())
    return run_dir


def test_short_run_writes_run_directory(cli, write_recipe, tmp_path):
    out = tmp_path / "runs"
    result = cli(["run", write_recipe(WITH_PLOT), "--out", out, "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "exact-loglik/test_loglik:" in result.output
    run_dir = only_run_dir(out)
    assert run_dir.parent.name == "small"

    # the resolved recipe holds the seed and every default
    from eblvm_core.recipe import load_recipe

    resolved = load_recipe(run_dir / "recipe.toml")
    assert resolved.run.seed == 7 and resolved.run.device == "cpu"
    assert resolved.optim["model"].optimizer.config.beta2 == 0.999

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in records if "train/loss" in r]
    assert train_steps == [10, 20, 30]
    final = [r for r in records if "eval/exact-loglik/test_loglik" in r]
    assert final and final[-1]["step"] == 30 and final[-1]["eval/density-plot/grid_mass"] > 0

    state = ckpt.load(run_dir / "checkpoints" / "last.pt")
    assert state["step"] == 30 and set(state["roles"]) == {"model"}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"images": 0}).Reload()
    tags = events.Tags()
    assert {"train/loss", "train/grad_norm/model", "lr/model", "eval/exact-loglik/test_loglik"} <= set(tags["scalars"])
    assert [s.step for s in events.Scalars("train/loss")] == [10, 20, 30]
    assert [s.step for s in events.Scalars("speed/steps_per_s")] == [10, 20, 30]
    assert "eval/density-plot/density" in tags["images"]

    # the HPARAMS dashboard: the resolved recipe's hyper-parameters, the final metrics by tag
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = events.PluginTagToContent("hparams")
    data = {tag: plugin_data_pb2.HParamsPluginData.FromString(raw) for tag, raw in content.items()}
    (experiment,) = [d.experiment for d in data.values() if d.HasField("experiment")]
    assert {m.name.tag for m in experiment.metric_infos} == set(final[-1]) - {"step"}
    (start,) = [d.session_start_info for d in data.values() if d.HasField("session_start_info")]
    hparams = start.hparams
    assert hparams["model.n_hidden"].number_value == 4 and hparams["run.seed"].number_value == 7
    assert hparams["estimator.kind"].string_value == "exact-score"
    assert not any(key.startswith(("eval.", "log.")) for key in hparams)


def test_seed_is_chosen_and_written_back(cli, write_recipe, tmp_path):
    out = tmp_path / "runs"
    result = cli(["run", write_recipe(SMALL_RECIPE.replace("seed = 7\n", "")), "--out", out, "-o", "run.steps=2"])
    assert result.exit_code == 0, result.output
    from eblvm_core.recipe import load_recipe

    assert isinstance(load_recipe(only_run_dir(out) / "recipe.toml").run.seed, int)


def params(run_dir: Path) -> dict[str, torch.Tensor]:
    return ckpt.load(run_dir / "checkpoints" / "last.pt")["networks"]["model"]


@pytest.mark.slow
def test_kill_and_resume_matches_uninterrupted_run(write_recipe, tmp_path):
    from eblvm_core.session import run

    recipe = write_recipe(
        SMALL_RECIPE.replace("steps = 30", "steps = 1500").replace("checkpoint_every = 10", "checkpoint_every = 50")
    )
    quiet = lambda _msg: None  # noqa: E731
    full_dir, _ = run(recipe, out=tmp_path / "full", echo=quiet)

    out = tmp_path / "killed"
    kill_run_when(recipe, out, ready=lambda _checkpoint: True)
    killed_dir = only_run_dir(out)
    killed_at = ckpt.load(killed_dir / "checkpoints" / "last.pt")["step"]
    assert killed_at < 1500, "the run finished before it could be killed; the test proves nothing"

    run(None, resume=killed_dir, echo=quiet)
    a, b = params(full_dir), params(killed_dir)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # metrics of the resumed part are appended, not rewritten
    steps = [json.loads(line)["step"] for line in (killed_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 1500


def test_nan_loss_stops_cleanly_and_keeps_last_good_checkpoint(cli, write_recipe, tmp_path, monkeypatch):
    import eblvm_core.session as session_module

    real_build = session_module.build

    def build_with_nan(*args, **kwargs):
        built = real_build(*args, **kwargs)
        estimator, real_step, count = built.parts.estimator, built.parts.estimator.step, [0]

        def step(batch):
            count[0] += 1
            metrics = real_step(batch)
            if count[0] == 25:
                with torch.no_grad():
                    built.parts.model.W.fill_(float("nan"))
                metrics["loss"] = float("nan")
            return metrics

        estimator.step = step
        return built

    monkeypatch.setattr(session_module, "build", build_with_nan)
    out = tmp_path / "runs"
    result = cli(["run", write_recipe(), "--out", out])
    assert result.exit_code == 3
    assert "step 25: training loss is nan" in result.output
    assert "last good checkpoint" in result.output and "(step 20)" in result.output
    state = ckpt.load(only_run_dir(out) / "checkpoints" / "last.pt")
    assert state["step"] == 20
    assert all(torch.isfinite(t).all() for t in state["networks"]["model"].values())


def test_resume_needs_a_run_directory(cli, tmp_path):
    result = cli(["run", "--resume", tmp_path])
    assert (
        result.exit_code == 2
        and f"{tmp_path}: cannot resume: not a run directory: it has no recipe.toml" in result.output
    )
    result = cli(["run", "--resume", tmp_path / "gone"])
    assert result.exit_code == 2 and f"{tmp_path / 'gone'}: cannot resume: no such directory" in result.output


def test_atomic_save_leaves_old_file_on_failure(tmp_path):
    path = tmp_path / "c.pt"
    ckpt.save_atomic({"x": torch.ones(2)}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    try:
        ckpt.save_atomic({"x": Unpicklable()}, path)
    except RuntimeError:
        pass
    assert torch.equal(ckpt.load(path)["x"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"], "no temp file may be left behind"


def test_checkpoints_load_weights_only(tmp_path):
    import pickle

    path = tmp_path / "evil.pt"

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"x": Evil()}, path, pickle_module=pickle)
    try:
        ckpt.load(path)
    except pickle.UnpicklingError:
        return
    raise AssertionError("a checkpoint with arbitrary objects must not load")


def test_the_readme_recipe_is_the_main_job():
    """The README's recipe block and recipes/grbm_bissm.toml say the same thing (comments aside)."""
    import re
    import tomllib

    root = ROOT
    (block,) = re.findall(r"```toml\n(\[run\].*?)```", (root / "README.md").read_text(), flags=re.S)
    assert tomllib.loads(block) == tomllib.loads((root / "recipes" / "grbm_bissm.toml").read_text())


def test_the_console_shows_evaluations_as_they_run(cli, write_recipe, tmp_path):
    """Each evaluation before the end prints its results; a long one announces itself first; log
    lines before the last carry an ETA; a tiny model on a CPU gets one thread."""
    text = SMALL_RECIPE.replace("checkpoint_every = 10", "checkpoint_every = 10\neval_every = 20")
    text += '\n[[eval]]\nkind = "ais-loglik"\nn_chains = 30\nn_reverse_chains = 20\nn_temps = 40\n'
    result = cli(["run", write_recipe(text), "--out", tmp_path / "runs", "--device", "cpu", "-o", "run.threads=0"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "1 CPU thread)" in lines[0]
    assert "step 20: ais-loglik: AIS: 30 chains × 40 temperatures forward, 20 chains back…" in lines
    assert sum("ais-loglik: AIS: 30 chains" in line for line in lines) == 2  # at step 20 and at the end
    (evaluated,) = [line for line in lines if line.startswith("eval step 20: ")]
    row = next(r for r in metrics(only_run_dir(tmp_path / "runs")) if r["step"] == 20 and "eval/ais-loglik/log_z" in r)
    assert f"exact-loglik/test_loglik {row['eval/exact-loglik/test_loglik']:.5g}" in evaluated
    assert f"ais-loglik/log_z {row['eval/ais-loglik/log_z']:.5g}" in evaluated
    steps = [line for line in lines if line.startswith("step ") and "loss" in line]
    assert [("ETA " in line) for line in steps] == [True, True, False]  # not on the last
    assert json.loads((only_run_dir(tmp_path / "runs") / "run.json").read_text())["sessions"][0]["threads"] == 1


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_threads_are_chosen_by_model_size():
    """[run] threads = 0: one thread on a CPU below SMALL_MODEL parameters, torch's setting above it
    and on other devices; a positive value is used as it is."""
    from torch import nn

    from eblvm_core.context import SMALL_MODEL, set_threads
    from eblvm_core.contracts import Parts

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        small, large = Parts(), Parts()
        small.model = nn.Linear(10, 10)
        large.model = nn.Linear(SMALL_MODEL, 1)  # SMALL_MODEL + 1 parameters
        assert set_threads(0, torch.device("cpu"), large) == 2
        assert set_threads(0, torch.device("meta"), small) == 2
        assert set_threads(0, torch.device("cpu"), small) == 1
        assert set_threads(3, torch.device("cpu"), small) == 3
    finally:
        torch.set_num_threads(before)


def test_device_auto_keeps_models_below_the_measured_size_on_the_cpu():
    """The trainable parameters of every role are counted (frozen ones are not); a GRBM with a
    posterior at Frey-face size with 400 hidden units is above the threshold, with 20 below."""
    from eblvm_core.build import AUTO_GPU_MIN_PARAMETERS, prefers_cpu
    from eblvm_core.testing import tiny_grbm_setup

    def grbm_with_posterior(d: int, m: int):
        return tiny_grbm_setup(d=d, m=m, n=4).parts

    small = grbm_with_posterior(2, 4)
    expected = sum(p.numel() for net in (small.model, small.posterior) for p in net.parameters())
    assert prefers_cpu(small.networks()) == expected
    small.posterior.requires_grad_(False)
    assert prefers_cpu(small.networks()) == expected - sum(p.numel() for p in small.posterior.parameters())
    assert prefers_cpu(grbm_with_posterior(560, 20).networks()) is not None
    frey = grbm_with_posterior(560, 400)
    assert prefers_cpu(frey.networks()) is None
    assert sum(p.numel() for p in frey.model.parameters()) > AUTO_GPU_MIN_PARAMETERS


@pytest.mark.parametrize(
    "recipe, overrides, on_cpu",
    [
        ("grbm_bissm.toml", [], None),  # small, but its step is replayed from a CUDA graph
        ("grbm_bissm.toml", ["run.cuda_graph=false"], "[run] cuda_graph = false"),
        ("grbm_bism_implicit.toml", [], "the estimator does not declare its step graph-safe"),
        ("grbm_cd.toml", [], "the estimator does not declare its step graph-safe"),
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
    """Decided from the recipe and the networks alone, before anything is placed: with a GPU in
    view (``device`` cuda, ``auto``) a run whose step would not be replayed is built on the CPU,
    once, without touching the GPU."""
    from eblvm_core.build import auto_on_cpu, build
    from eblvm_core.recipe import load_recipe
    from eblvm_core.roles import Precision

    spec = load_recipe(RECIPES / recipe, [*overrides, "~eval"])
    networks = build(spec, torch.device("cpu")).parts.networks()
    why = auto_on_cpu(spec, networks, Precision(spec.run.precision, "cuda"))
    if on_cpu is None:
        assert why is None
        return
    assert why is not None and on_cpu in why and "trainable parameters" in why, why
    built = build(spec, torch.device("cuda"), auto=True)
    assert built.device == torch.device("cpu") and built.cpu_because == why
    assert all(p.device.type == "cpu" for net in built.parts.networks().values() for p in net.parameters())


def test_a_checkpoint_moves_to_a_device_whole():
    state = {"a": torch.ones(2), "b": [torch.zeros(1), (torch.ones(1), 3)], "c": "x"}
    moved = ckpt.to_device(state, torch.device("meta"))
    assert moved["a"].is_meta and moved["b"][0].is_meta and moved["b"][1][0].is_meta
    assert isinstance(moved["b"][1], tuple) and moved["b"][1][1] == 3 and moved["c"] == "x"


@pytest.mark.slow
def test_a_resumed_run_does_not_show_tensorboard_twice_what_it_logs_again(tmp_path):
    """A run killed after its last checkpoint logged steps that the resumed run logs again;
    TensorBoard must show each step once (the resumed writer purges what followed the checkpoint)."""
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from eblvm_core.session import run

    recipe = tmp_path / "small.toml"
    recipe.write_text(SMALL_RECIPE)
    quiet = lambda _: None  # noqa: E731
    run_dir, _ = run(recipe, ["run.steps=20", "run.log_every=5"], out=tmp_path / "runs", echo=quiet)
    at_20 = tmp_path / "at_20.pt"
    shutil.copy(run_dir / "checkpoints" / "last.pt", at_20)
    time.sleep(1.1)  # event files are ordered by their names, which hold the second they were opened
    run(None, ["run.steps=30"], resume=run_dir, echo=quiet)
    shutil.copy(at_20, run_dir / "checkpoints" / "last.pt")  # as if killed after logging 25 and 30
    time.sleep(1.1)
    run(None, ["run.steps=30"], resume=run_dir, echo=quiet)
    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    assert [s.step for s in events.Scalars("train/loss")] == [5, 10, 15, 20, 25, 30]
    assert [s.step for s in events.Scalars("eval/exact-loglik/test_loglik")] == [20, 30]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [5, 10, 15, 20, 25, 30]


def test_a_cpu_run_flushes_subnormal_floats_while_it_trains_and_only_then(write_recipe, tmp_path, monkeypatch):
    """Inside a CPU run a subnormal float32 (1e-39) multiplies to 0, so the relaxed samples'
    subnormals cost no slow path; before and after the run, also one that fails, it is itself."""
    from eblvm_core.session import run as train

    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU cannot flush subnormal floats")
    tiny = torch.tensor(1e-39)
    seen: list[float] = []
    poison_at(monkeypatch, 3, lambda built, metrics: seen.append((tiny * 1.0).item()))
    assert (tiny * 1.0).item() > 0
    train(write_recipe(), ["run.steps=5"], "cpu", tmp_path / "runs", echo=lambda _: None)
    assert seen == [0.0] and (tiny * 1.0).item() > 0

    def fail(built, metrics):
        raise RuntimeError("a step that fails")

    poison_at(monkeypatch, 2, fail)
    with pytest.raises(RuntimeError, match="a step that fails"):
        train(write_recipe(), ["run.steps=5"], "cpu", tmp_path / "failed", echo=lambda _: None)
    assert (tiny * 1.0).item() > 0


def test_a_role_whose_gradient_stays_zero_is_reported_once(write_recipe, tmp_path, monkeypatch):
    """A role whose mean gradient norm over a log interval is exactly 0 (e.g. BiDVL's energy behind a
    saturated softplus) is named once in the run log; a run whose gradients move says nothing."""
    from eblvm_core.roles import TrainingRole
    from eblvm_core.session import run
    from tests.support import BISM

    recipe = write_recipe(BISM)
    said: list[str] = []
    run(recipe, out=tmp_path / "alive", echo=said.append)
    assert not [line for line in said if "stopped training" in line]

    real = TrainingRole.take_mean_grad_norm
    monkeypatch.setattr(TrainingRole, "take_mean_grad_norm", lambda role: 0.0 * real(role))
    said.clear()
    run(recipe, out=tmp_path / "dead", echo=said.append)
    warned = [line for line in said if "stopped training" in line]
    assert len(warned) == 2 and "role 'model'" in warned[0] and "role 'posterior'" in warned[1], said


def test_cudnn_autotuning_is_on_only_inside_a_cuda_run_that_asks_for_it():
    """[run] cudnn_benchmark turns cuDNN's timing of algorithms on for a CUDA run's block and puts
    the previous setting back, also when the block fails; a CPU run or a run without it leaves it."""
    from eblvm_core.context import cudnn_autotuned

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert torch.backends.cudnn.benchmark is False  # torch's default, which the runs keep unless asked
    seen = []
    for device, enabled in [(cuda, True), (cuda, False), (cpu, True)]:
        with cudnn_autotuned(device, enabled):
            seen.append(torch.backends.cudnn.benchmark)
        assert torch.backends.cudnn.benchmark is False
    assert seen == [True, False, False]
    with pytest.raises(RuntimeError, match="fails"), cudnn_autotuned(cuda, True):
        raise RuntimeError("a block that fails")
    assert torch.backends.cudnn.benchmark is False


@pytest.mark.slow
def test_evaluating_along_the_way_leaves_the_training_as_it_was(tmp_path):
    """digits_bidvl's energy is spectrally normalised and its encoder and generator hold batch norm:
    ood-auroc (the energy) and reconstruction (the encoder and the generator, also in train mode)
    every 5 steps must leave the same networks, buffers included, to the bit, as no evaluation."""
    import tomllib

    import eblvm

    data = tomllib.loads((RECIPES / "digits_bidvl.toml").read_text())
    data["run"].update(steps=15, checkpoint_every=15, eval_every=5, threads=1)
    for section in ("model", "posterior", "generator"):
        data[section]["base"] = 8
    data["eval"] = [{"kind": "ood-auroc", "n": 100}, {"kind": "reconstruction", "n": 100, "batch_size": 50}]
    along = eblvm.train(data, out=tmp_path / "along", echo=None).run_dir
    data["eval"] = []
    without = eblvm.train(data, out=tmp_path / "without", echo=None).run_dir

    records = [json.loads(line) for line in (along / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval/ood-auroc/uniform_auroc" in r] == [5, 10, 15]
    a, b = (ckpt.load(d / "checkpoints" / "last.pt")["networks"] for d in (along, without))
    assert a.keys() == b.keys() == {"model", "posterior", "generator"}
    for section in a:
        assert a[section].keys() == b[section].keys()
        for key in a[section]:
            assert torch.equal(a[section][key], b[section][key]), f"{section}.{key}"


def test_evaluation_mode_puts_back_the_modes_and_buffers_whatever_the_evaluator_did():
    from eblvm_core.contracts import evaluation_mode

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    net[0].eval()  # modes differ between submodules
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with evaluation_mode([net]):
        assert not any(m.training for m in net.modules())
        net.train()  # an evaluator that reads batch statistics and leaves them moved
        net(torch.randn(8, 2))
        assert not torch.equal(net[1].running_mean, before["1.running_mean"])
    assert [m.training for m in net.modules()] == [True, False, True]
    for key, value in net.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_call_evaluators_keys_results_announces_and_keeps_the_callers_random_stream_when_asked():
    from eblvm_core.contracts import EvalResult, Parts
    from eblvm_core.state import call_evaluators

    def draw(_parts):
        return EvalResult(scalars={"u": float(torch.rand(()))})

    draw.announce = "one uniform draw"
    lines: list[str] = []
    torch.manual_seed(0)
    before = torch.get_rng_state()
    kept = call_evaluators(Parts(), [("draw", draw)], lines.append, keep_rng=True)
    assert torch.equal(torch.get_rng_state(), before)  # the caller's stream is where it was
    moved = call_evaluators(Parts(), [("draw", draw)], lines.append)
    assert not torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(0)
    assert kept.scalars == moved.scalars == {"eval/draw/u": float(torch.rand(()))}
    assert lines == ["draw: one uniform draw"] * 2


def test_a_run_builds_its_parts_once_even_when_device_auto_falls_back_to_the_cpu(write_recipe, tmp_path, monkeypatch):
    """With a GPU in view (``pick_device`` answers cuda) a small model whose step is not graph-safe
    (CD) trains on the CPU: the choice is made inside the one build, before anything is placed,
    and the run says why; nothing touches the GPU."""
    import eblvm_core.session as session_module
    from eblvm_core.session import run

    monkeypatch.setattr(session_module, "pick_device", lambda _choice: torch.device("cuda"))
    calls = []
    real_build = session_module.build

    def counted(*args, **kwargs):
        calls.append(args[1])
        return real_build(*args, **kwargs)

    monkeypatch.setattr(session_module, "build", counted)
    recipe = write_recipe((RECIPES / "grbm_cd.toml").read_text())
    said: list[str] = []
    run_dir, _ = run(recipe, ["run.steps=20", "~eval", 'run.device="auto"'], out=tmp_path / "runs", echo=said.append)
    assert calls == [torch.device("cuda")]
    assert any(line.startswith("device auto:") and "training on the CPU" in line for line in said), said
    assert "device cpu" in next(line for line in said if line.startswith("run directory:"))
    assert json.loads((run_dir / "run.json").read_text())["sessions"][0]["device"] == "cpu"
