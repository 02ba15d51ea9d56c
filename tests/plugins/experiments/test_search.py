"""``eblvm search``: Optuna studies over a recipe's keys on the checkerboard with tiny runs; pruned
trials end cleanly, a study in SQLite is continued by a later command and shared by concurrent
workers, an interrupted trial resumes its run; bad search specs get one line. Also the engine's
hook a search uses (``after_evaluation`` of a session), which needs no Optuna."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eblvm_core import checkpoint as ckpt
from tests.support import RECIPES, ROOT, SMALL_RECIPE, one_line_error, session_run
from tests.support.forked import STDOUT, Forked

NO_OPTUNA = "eblvm's 'search' extra (optuna) is not installed: pip install -e '.[search]'"
METRIC = "eval/exact-loglik/test_loglik"

# BiSSM on a small checkerboard, 60 steps with an evaluation every 20. The model's rate is a
# choice between one that learns (-1.59 nats at step 20) and one that does not (-2.23): the
# threshold pruner at -2.0 prunes the second kind at its first evaluation, whatever the others.
SPEC = """
[search]
name = "tiny"
recipe = "{recipe}"
metric = "eval/exact-loglik/test_loglik"
direction = "maximize"
n_trials = {n_trials}
sampler = "random"
seed = 3
pruner = "{pruner}"
pruner_options = {pruner_options}
overrides = [
    "run.steps={steps}", "run.eval_every=20", "run.checkpoint_every=20", "run.log_every=20", "run.device='cpu'",
    "~eval.2", "~eval.1", "data.n_train=2000", "data.n_test=1000",
]

[params]
"optim.model.lr" = [1e-2, 1e-6]
"optim.posterior.lr" = {{ low = 1e-4, high = 1e-2, log = true }}
"estimator.inner_lr" = {{ low = 0.5, high = 1.0 }}
"estimator.inner_steps" = {{ low = 1, high = 3 }}
"""
THRESHOLD = "{ lower = -2.0, n_warmup_steps = 0 }"


def write_spec(
    tmp_path: Path, n_trials: int = 6, steps: int = 60, pruner: str = "threshold", options: str = THRESHOLD, seed=True
) -> Path:
    path = tmp_path / "search.toml"
    text = SPEC.format(
        recipe=RECIPES / "grbm_bissm.toml", n_trials=n_trials, steps=steps, pruner=pruner, pruner_options=options
    )
    path.write_text(text if seed else text.replace("seed = 3\n", ""))
    return path


def study(out: Path):
    optuna = pytest.importorskip("optuna", reason=NO_OPTUNA)
    return optuna.load_study(study_name="tiny", storage=f"sqlite:///{out / 'study.db'}")


def recipe_value(recipe: dict, key: str):
    node = recipe
    for part in key.split("."):
        node = node[part]
    return node


def trial_runs(out: Path) -> dict[str, list[Path]]:
    """Run directories by run name (trial-NNNN)."""
    return {d.name: sorted(d.iterdir()) for d in sorted((out / "runs").iterdir())}


def eblvm(args: list, cwd: Path) -> Forked:
    return Forked(args, cwd=cwd, stderr=STDOUT)


# ---- the engine's hook ----------------------------------------------------------------------


@pytest.mark.slow
def test_after_evaluation_ends_a_run_cleanly_with_the_status_it_gives(write_recipe, tmp_path):
    """What a pruner does through a session's ``after_evaluation``: the evaluation it stops after
    is the run's last, last.pt holds that step, run.json says "pruned", and a resume goes on training."""
    from eblvm import Stop

    recipe = write_recipe(SMALL_RECIPE.replace("checkpoint_every = 10", "checkpoint_every = 10\neval_every = 10"))
    seen = []

    def after(step, scalars):
        seen.append(step)
        return Stop("pruned", f"pruned at step {step}") if step == 20 else None

    lines = []
    run_dir, final = session_run(recipe, out=tmp_path, echo=lines.append, after_evaluation=after)
    assert seen == [10, 20]  # not called for the final evaluation, nor after the stop
    assert "pruned at step 20" in lines
    assert final and METRIC in final
    assert ckpt.load(run_dir / "checkpoints" / "last.pt")["step"] == 20
    sessions = json.loads((run_dir / "run.json").read_text())["sessions"]
    assert [(s["status"], s["to_step"]) for s in sessions] == [("pruned", 20)]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == 20 and rows[-1][METRIC] == final[METRIC]

    session_run(None, resume=run_dir, echo=lambda _line: None)  # a pruned run is not finished: it trains on
    sessions = json.loads((run_dir / "run.json").read_text())["sessions"]
    assert [(s["status"], s["from_step"], s["to_step"]) for s in sessions][-1] == ("finished", 20, 30)


# ---- searching --------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_search_prunes_cleanly_and_a_second_command_continues_the_study(cli, tmp_path):
    pytest.importorskip("optuna", reason=NO_OPTUNA)
    spec, out = write_spec(tmp_path), tmp_path / "res"
    first = cli(["search", spec, "--out", out, "--n-trials", "4"])
    assert first.exit_code == 0, first.output
    before = {t.number: (t.state, t.params, t.value) for t in study(out).trials}
    assert sorted(before) == [0, 1, 2, 3]
    runs_before = trial_runs(out)

    second = cli(["search", spec, "--out", out])  # the spec's 6 trials: 2 more
    assert second.exit_code == 0, second.output
    assert "4 of 6 trials done" in second.output
    trials = study(out).trials
    assert [t.number for t in trials] == [0, 1, 2, 3, 4, 5]
    for t in trials[:4]:  # kept as they were, not run again
        assert (t.state, t.params, t.value) == before[t.number]
    runs = trial_runs(out)
    assert all(runs[name] == dirs for name, dirs in runs_before.items())
    assert sorted(runs) == [f"trial-{n:04d}" for n in range(6)] and all(len(d) == 1 for d in runs.values())

    states = {t.number: t.state.name for t in trials}
    assert "PRUNED" in states.values() and "COMPLETE" in states.values(), states
    for t in trials:
        (run_dir,) = runs[t.user_attrs["run_name"]]
        assert t.user_attrs["run_dir"] == str(run_dir)
        recipe = __import__("tomllib").loads((run_dir / "recipe.toml").read_text())
        for key, value in t.params.items():  # the run's recipe holds the trial's values
            assert recipe_value(recipe, key) == value, (t.number, key)
        session = json.loads((run_dir / "run.json").read_text())["sessions"][-1]
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in rows if METRIC in r]
        last_step = ckpt.load(run_dir / "checkpoints" / "last.pt")["step"]
        if t.state.name == "PRUNED":  # ended cleanly at the evaluation that pruned it
            assert recipe_value(recipe, "optim.model.lr") == 1e-6
            assert (session["status"], session["to_step"], last_step) == ("pruned", 20, 20)
            assert t.intermediate_values == {20: evals[-1][METRIC]} and evals[-1]["step"] == 20
        else:  # the trial's value is its run's final evaluation
            assert (session["status"], last_step) == ("finished", 60)
            assert t.value == evals[-1][METRIC] and evals[-1]["step"] == 60
            assert sorted(t.intermediate_values) == [20, 40]

    table = (out / "table.md").read_text()
    assert table.count("| pruned |") == list(states.values()).count("PRUNED")
    assert len([line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]) == 6
    assert len(json.loads((out / "results.json").read_text())["trials"]) == 6
    assert (out / "history.png").stat().st_size > 0 and (out / "intermediate.png").stat().st_size > 0

    third = cli(["search", spec, "--out", out])
    assert third.exit_code == 0 and "nothing to run" in third.output, third.output
    assert len(study(out).trials) == 6


@pytest.mark.slow
def test_two_concurrent_workers_share_the_study_without_running_a_trial_twice(tmp_path):
    pytest.importorskip("optuna", reason=NO_OPTUNA)
    spec, out = write_spec(tmp_path, seed=False), tmp_path / "res"  # two commands at once: unseeded samplers
    workers = [eblvm(["search", spec, "--out", out], tmp_path) for _ in range(2)]
    outputs = [w.communicate(timeout=600)[0] for w in workers]
    for w, output in zip(workers, outputs):
        assert w.returncode == 0, output
    trials = study(out).trials
    settled = [t for t in trials if t.state.name in ("COMPLETE", "PRUNED")]
    assert len(settled) == len(trials)
    assert 6 <= len(trials) <= 7  # near the end each worker may start one more (Optuna's MaxTrialsCallback)
    ran = [{int(line.split()[1].rstrip(":")) for line in o.splitlines() if line.startswith("trial ")} for o in outputs]
    assert ran[0] and ran[1], "both workers must have run trials"
    assert not ran[0] & ran[1] and ran[0] | ran[1] == {t.number for t in trials}
    runs = trial_runs(out)  # one run directory per trial, each with its own trial's values
    assert sorted(runs) == [f"trial-{t.number:04d}" for t in trials]
    for t in trials:
        (run_dir,) = runs[f"trial-{t.number:04d}"]
        recipe = __import__("tomllib").loads((run_dir / "recipe.toml").read_text())
        assert all(recipe_value(recipe, key) == value for key, value in t.params.items()), t.number


@pytest.mark.slow
def test_a_trial_stopped_by_a_signal_resumes_its_run_in_the_next_command(tmp_path):
    """SIGTERM mid-trial: the run writes its checkpoint, the trial is queued again with its values,
    and the next ``eblvm search`` resumes that run directory, which ends as an uninterrupted run."""
    pytest.importorskip("optuna", reason=NO_OPTUNA)
    spec, out = write_spec(tmp_path, n_trials=1, steps=300, pruner="none", options="{}"), tmp_path / "res"
    first = eblvm(["search", spec, "--out", out], tmp_path)
    deadline = time.time() + 300
    while time.time() < deadline and not list(out.glob("runs/trial-0000/*/checkpoints/last.pt")):
        time.sleep(0.05)
    first.send_signal(signal.SIGTERM)
    output = first.communicate(timeout=300)[0]
    assert first.returncode == 130, output
    assert "trial 0 is queued again" in output.splitlines()[-1], output
    (run_dir,) = trial_runs(out)["trial-0000"]
    stopped_at = ckpt.load(run_dir / "checkpoints" / "last.pt")["step"]
    assert stopped_at < 300, "the trial finished before the signal; the test proves nothing"
    trials = study(out).trials
    assert [t.state.name for t in trials] == ["FAIL", "WAITING"] and trials[1].params == trials[0].params

    second = eblvm(["search", spec, "--out", out], tmp_path)
    output = second.communicate(timeout=300)[0]
    assert second.returncode == 0, output
    assert f"(resumes {run_dir})" in output
    trials = study(out).trials
    assert [t.state.name for t in trials] == ["FAIL", "COMPLETE"]
    assert trial_runs(out) == {"trial-0000": [run_dir]}  # the same run, continued
    # what the first trial reported is inherited, the resumed run reports the rest: every evaluation once
    assert trials[0].intermediate_values.items() <= trials[1].intermediate_values.items()
    assert sorted(trials[1].intermediate_values) == list(range(20, 300, 20))
    assert "| 0 | stopped, resumed as trial 1 |" in (out / "table.md").read_text()
    sessions = json.loads((run_dir / "run.json").read_text())["sessions"]
    assert [(s["status"], s["from_step"]) for s in sessions] == [("interrupted", 0), ("finished", stopped_at)]
    reference, _ = session_run(run_dir / "recipe.toml", out=tmp_path / "reference", echo=lambda _line: None)
    a = ckpt.load(run_dir / "checkpoints" / "last.pt")["networks"]
    b = ckpt.load(reference / "checkpoints" / "last.pt")["networks"]
    for role in a:
        for key in a[role]:
            assert torch.equal(a[role][key], b[role][key]), (role, key)


# ---- bad specs and a missing extra ------------------------------------------------------------

BAD = [
    ("params", None, "", "[params]: list the recipe keys to search"),
    ("params", '"optim.model.lr" = { low = 1e-2, high = 1e-4 }', "", "[params] optim.model.lr: low must be below high"),
    ("params", '"optim.model.lr" = { low = 0.0, high = 1e-2, log = true }', "", "a log range must stay above 0"),
    ("params", '"optim.model.lr" = { low = 1e-4, hi = 1e-2 }', "", "[params] optim.model.lr: unknown key 'hi'"),
    ("params", '"estimator.inner_steps" = { low = 1, high = 2.5, type = "int" }', "", "an int range needs int ends"),
    ("params", '"optim.model.lr" = [1e-3, 1e-3]', "", "choices must differ"),
    ("params", '"run.seed" = [1, 2]', "", "[params] run.seed: cannot be searched"),
    ("params", '"estimator.inner_steps" = { low = 0, high = 5 }', "", "(searched value estimator.inner_steps = 0 of"),
    ("params", '"estimator.inner_stepz" = { low = 1, high = 5 }', "", "inner_stepz"),
    ("search", None, 'metric = "eval/exact-loglik/test_logl"', "[search] metric: no evaluator of the recipe reports"),
    ("search", None, 'sampler = "tpee"', "[search] sampler: must be one of"),
    ("search", None, "pruner_options = { n_warmup = 3 }", "[search] pruner_options:"),
    (
        "search",
        None,
        'overrides = ["run.eval_every=0"]',
        "[search] pruner: 'median' goes by evaluations during training",
    ),
    ("search", None, "direction = ''", "[search] direction: required key is missing"),
]


@pytest.mark.parametrize("section, param, search_line, expected", BAD, ids=[b[3][:40] for b in BAD])
def test_a_bad_search_spec_is_one_line_from_validate(cli, tmp_path, section, param, search_line, expected):
    if "pruner_options" in search_line:
        pytest.importorskip("optuna", reason=NO_OPTUNA)  # checked against Optuna's own classes
    search = {
        "name": '"bad"',
        "recipe": f'"{RECIPES / "grbm_bissm.toml"}"',
        "metric": '"eval/exact-loglik/test_loglik"',
        "direction": '"maximize"',
        "overrides": '["run.eval_every=100"]',
    }
    if search_line:
        key, _, value = search_line.partition(" = ")
        search[key] = value
    text = "[search]\n" + "".join(f"{k} = {v}\n" for k, v in search.items() if v != "''")
    if param is not None:
        text += f"\n[params]\n{param}\n"
    elif section != "params":
        text += '\n[params]\n"optim.model.lr" = { low = 1e-4, high = 1e-2, log = true }\n'
    path = tmp_path / "bad.toml"
    path.write_text(text)
    line = one_line_error(cli(["validate", path]))
    assert expected in line, line
    assert str(path) in line or "grbm_bissm.toml" in line, line  # the file that is wrong is named


def test_the_bundled_search_spec_is_valid(cli):
    result = cli(["validate", ROOT / "recipes" / "search" / "bissm_checkerboard.toml"])
    assert result.exit_code == 0, result.output


def test_a_study_made_by_another_search_is_refused_in_one_line(cli, tmp_path):
    pytest.importorskip("optuna", reason=NO_OPTUNA)
    from eblvm_experiments.search import open_study
    from eblvm_experiments.search_spec import load_search_spec

    spec, out = write_spec(tmp_path), tmp_path / "res"
    open_study(load_search_spec(spec), f"sqlite:///{out / 'study.db'}")  # made, no trial yet
    spec.write_text(spec.read_text().replace("high = 3 }", "high = 5 }"))
    line = one_line_error(cli(["search", spec, "--out", out]))
    assert "the study 'tiny'" in line and "was made by another search (it differs in: params)" in line, line


def test_a_storage_that_cannot_be_opened_is_one_line_without_its_password(cli, tmp_path):
    pytest.importorskip("optuna", reason=NO_OPTUNA)
    for url in ("nonsense", "postgresql+nosuchdriver://bob:secret@localhost:1/x"):
        line = one_line_error(cli(["search", write_spec(tmp_path), "--out", tmp_path / "res", "--storage", url]))
        assert "[search] storage: " in line and "secret" not in line, line


def test_search_without_the_extra_names_it(cli, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna fails as when it is not installed
    line = one_line_error(cli(["search", write_spec(tmp_path), "--out", tmp_path / "res"]))
    assert "eblvm search needs Optuna, eblvm's 'search' extra: pip install" in line and "[search]" in line, line


def test_no_trial_recipe_reaches_a_searched_key_from_the_command_line(cli, tmp_path):
    line = one_line_error(cli(["validate", write_spec(tmp_path), "-o", "optim.model.lr=0.1"]))
    assert "[params] optim.model.lr: -o optim.model.lr=0.1: the search sets this key in every trial" in line, line


@pytest.mark.slow
def test_the_commands_of_many_runs_import_neither_extra_until_they_use_it():
    """compare, validate and everything else work without the extras: the modules load without them."""
    code = (
        "import sys\n"
        "import eblvm_experiments, eblvm_experiments.compare, eblvm_experiments.search, eblvm_core.cli\n"
        "print(sorted(m for m in ('optuna', 'submitit') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ})
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_the_search_plots_leave_matplotlib_settings_as_they_found_them(tmp_path):
    """Optuna's plots set the ggplot style globally; after the search's plots every matplotlib
    setting is as before, so figures drawn later in the process (the density plots) look the same."""
    optuna = pytest.importorskip("optuna")
    import matplotlib
    from eblvm_experiments.search import _plots

    study = optuna.create_study(direction="maximize")
    for x in (0.1, 0.5, 0.9):
        study.enqueue_trial({"x": x})
    study.optimize(lambda trial: -((trial.suggest_float("x", 0.0, 1.0) - 0.3) ** 2), n_trials=3)
    before = dict(matplotlib.rcParams)
    _plots(study, tmp_path, complete=3, metric="m")
    assert (tmp_path / "history.png").is_file()
    assert dict(matplotlib.rcParams) == before
