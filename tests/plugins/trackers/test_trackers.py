"""The tracker loggers of plugins/eblvm_trackers: the CSV table (always), Weights & Biases and MLflow
(when their extra is installed: offline W&B runs read back from their files, MLflow runs from their
database). Each reads back what a small run logged and compares it with metrics.jsonl."""

from __future__ import annotations

import csv
import glob
import importlib
import json
import math
import re
import shutil
import struct
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from eblvm_core import plugins, testing
from tests.support import ROOT, SMALL_RECIPE, only_run_dir

LOG = {kind: f'\n[[log]]\nkind = "{kind}"\n' for kind in ("csv", "wandb", "mlflow")}
IMAGES = '\n[[eval]]\nkind = "density-plot"\n'  # an evaluator that returns an image on 2-D data


def train(cli, write_recipe, tmp_path: Path, text: str, *overrides: str) -> Path:
    out = tmp_path / "runs"
    args = ["run", write_recipe(text), "--out", out]
    for override in overrides:
        args += ["-o", override]
    result = cli(args)
    assert result.exit_code == 0, result.output
    return only_run_dir(out)


def resume(cli, run_dir: Path, *overrides: str) -> None:
    args = ["run", "--resume", run_dir]
    for override in overrides:
        args += ["-o", override]
    result = cli(args)
    assert result.exit_code == 0, result.output


def jsonl_rows(run_dir: Path) -> list[dict[str, float]]:
    """metrics.jsonl's training and evaluation rows as {key: float} with "step", non-finite values restored."""
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "checkpoint" in row:
            continue
        bad = row.pop("nonfinite", {})
        rows.append({key: float(bad[key]) if value is None else float(value) for key, value in row.items()})
    return rows


def csv_rows(path: Path) -> tuple[list[str], list[dict[str, float]]]:
    """(header, rows as {key: float} of the non-empty cells)."""
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        rows = [{key: float(value) for key, value in row.items() if value != ""} for row in reader]
        return list(reader.fieldnames or []), rows


def same(a: dict[str, float], b: dict[str, float]) -> bool:
    """Equal keys and bit-equal values (NaN equal to NaN)."""
    return a.keys() == b.keys() and all(repr(a[k]) == repr(b[k]) for k in a)


def by_step(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    """Rows of one step merged into one, as the CSV table keeps them (training and evaluation)."""
    merged: dict[float, dict[str, float]] = {}
    for row in rows:
        merged.setdefault(row["step"], {}).update(row)
    return list(merged.values())


def first_appearance(rows: list[dict[str, float]]) -> list[str]:
    keys: list[str] = []
    for row in rows:
        keys += [key for key in row if key not in keys]
    return keys


def copy_checkpoint_back(run_dir: Path, saved: Path) -> None:
    """As if the run had been killed after logging what followed the checkpoint ``saved``."""
    shutil.copy(saved, run_dir / "checkpoints" / "last.pt")


# ---- CSV -----------------------------------------------------------------------------------------


def test_csv_holds_the_rows_of_metrics_jsonl(cli, write_recipe, tmp_path):
    run_dir = train(cli, write_recipe, tmp_path, SMALL_RECIPE + LOG["csv"])
    header, rows = csv_rows(run_dir / "metrics.csv")
    expected = by_step(jsonl_rows(run_dir))
    assert len(rows) == len(expected) == 3  # training at 10, 20 and 30, which holds the final evaluation
    assert all(same(a, b) for a, b in zip(rows, expected)), (rows, expected)
    assert header == ["step", "checkpoint", *first_appearance(expected)[1:]]


def test_csv_widens_its_header_and_writes_non_finite_values_readably(tmp_path):
    logger = testing.make("loggers", "csv", tmp_path)
    logger.log_scalars(1, {"a": 0.1, "n": 3})
    logger.log_scalars(2, {"a": float("nan")})
    logger.log_scalars(3, {"b": float("inf"), "a": -float("inf")})
    logger.log_scalars(4, {"a": 1 / 3})
    logger.log_images(4, {"x": torch.rand(3, 2, 2)})
    logger.close()
    text = (tmp_path / "metrics.csv").read_text()
    assert text == "step,checkpoint,a,n,b\n1,,0.1,3,\n2,,nan,,\n3,,-inf,,inf\n4,,0.3333333333333333,,\n"
    _, rows = csv_rows(tmp_path / "metrics.csv")
    assert rows[3]["a"] == 1 / 3  # repr: read back exactly


def test_pandas_reads_the_csv_with_its_empty_and_non_finite_cells(tmp_path):
    pandas = pytest.importorskip("pandas")
    logger = testing.make("loggers", "csv", tmp_path)
    logger.log_scalars(1, {"a": 0.1, "n": 3})
    logger.log_scalars(2, {"a": float("nan")})
    logger.log_scalars(3, {"b": float("inf"), "a": -float("inf")})
    logger.log_scalars(4, {"a": 1 / 3})
    frame = pandas.read_csv(tmp_path / "metrics.csv")
    assert list(frame.columns) == ["step", "checkpoint", "a", "n", "b"] and frame["step"].tolist() == [1, 2, 3, 4]
    assert math.isnan(frame["a"][1]) and frame["a"][2] == -math.inf and frame["b"][2] == math.inf
    assert math.isnan(frame["b"][0])  # an empty cell


def test_csv_resume_drops_the_rows_after_the_checkpoint_and_a_cut_last_line(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text("step,a,eval/x,late\n5,1.0,,\n10,2.0,,\n10,,0.5,\n15,3.0,,7.0\n2")  # killed writing step 20
    logger = testing.make("loggers", "csv", tmp_path)
    logger.resume(10, final_pending=False)
    assert path.read_text() == "step,checkpoint,a,eval/x\n5,,1.0,\n10,,2.0,0.5\n"  # step 10's rows in one
    logger.log_scalars(15, {"a": 3.5})
    logger.resume(10, final_pending=True)  # the final evaluation at 10 runs again
    assert path.read_text() == "step,checkpoint,a\n5,,1.0\n10,,2.0\n"


def test_csv_resumed_twice_equals_metrics_jsonl_with_each_step_once(cli, write_recipe, tmp_path):
    """Trained to 20, continued to 30, then put back to the step-20 checkpoint (as if killed after
    logging 25 and 30) and continued again: each step once, as in metrics.jsonl."""
    run_dir = train(cli, write_recipe, tmp_path, SMALL_RECIPE + LOG["csv"], "run.steps=20", "run.log_every=5")
    saved = tmp_path / "at_20.pt"
    shutil.copy(run_dir / "checkpoints" / "last.pt", saved)
    resume(cli, run_dir, "run.steps=30")
    copy_checkpoint_back(run_dir, saved)
    resume(cli, run_dir, "run.steps=30")
    header, rows = csv_rows(run_dir / "metrics.csv")
    assert [r["step"] for r in rows if "train/loss" in r] == [5, 10, 15, 20, 25, 30]
    assert [r["step"] for r in rows if "eval/exact-loglik/test_loglik" in r] == [20, 30]
    expected = by_step(jsonl_rows(run_dir))
    assert len(rows) == len(expected) and all(same(a, b) for a, b in zip(rows, expected))
    assert header == ["step", "checkpoint", *first_appearance(expected)[1:]]


def test_csv_after_a_session_killed_in_its_final_evaluation_has_it_once(cli, write_recipe, tmp_path):
    """A session that wrote its final checkpoint but not its end in run.json is resumed: the final
    evaluation runs again, and its rows replace the earlier ones in the CSV as in metrics.jsonl."""
    run_dir = train(cli, write_recipe, tmp_path, SMALL_RECIPE + LOG["csv"])
    provenance = json.loads((run_dir / "run.json").read_text())
    provenance["sessions"][-1]["status"] = "running"  # as if killed during the final evaluation
    (run_dir / "run.json").write_text(json.dumps(provenance))
    resume(cli, run_dir)
    _, rows = csv_rows(run_dir / "metrics.csv")
    assert [r["step"] for r in rows if "eval/exact-loglik/test_loglik" in r] == [30]
    expected = by_step(jsonl_rows(run_dir))
    assert len(rows) == len(expected) == 3 and all(same(a, b) for a, b in zip(rows, expected))


def test_csv_refuses_a_file_outside_the_run_directory(cli, write_recipe):
    result = cli(["validate", write_recipe(SMALL_RECIPE + LOG["csv"] + 'file = "../x.csv"\n')])
    assert result.exit_code == 2
    assert "[log.0] file: must be a plain file name inside the run directory" in result.output


def test_the_logger_of_the_plugin_guide_writes_pngs_and_resumes(tmp_path, monkeypatch):
    """docs/plugins.md's complete logger, as written there: registered, contract, files, resume."""
    text = (ROOT / "docs" / "plugins.md").read_text()
    (code,) = re.findall(r'^```python title="png_logger.py"\n(.*?)^```$', text, re.M | re.S)
    (tmp_path / "eblvm_pngs.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("EBLVM_PLUGIN_MODULES", "eblvm_pngs")
    try:
        assert plugins.load(force=True)["loggers"].get("png").plugin == "eblvm_pngs"
    finally:
        monkeypatch.delenv("EBLVM_PLUGIN_MODULES")
        plugins.load(force=True)
    module = importlib.import_module("eblvm_pngs")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    testing.check_logger(module.build_png(module.PNGConfig(), run_dir), run_dir)
    logger = module.build_png(module.PNGConfig(), run_dir)
    grey, colour = torch.rand(1, 4, 5), torch.rand(3, 4, 5)
    for step in (5, 10):
        logger.log_images(step, {"eval/a/grey": grey, "eval/a/colour": colour})
    logger.resume(5)
    files = sorted(p.relative_to(run_dir / "images").as_posix() for p in run_dir.rglob("*.png"))
    assert files == ["eval/a/colour/00000005.png", "eval/a/grey/00000005.png", "eval/x/image/00000001.png"]
    pixels = lambda image: (image * 255).round().byte().permute(1, 2, 0).squeeze(-1).numpy()  # noqa: E731
    assert np.array_equal(np.array(Image.open(run_dir / "images/eval/a/colour/00000005.png")), pixels(colour))
    assert np.array_equal(np.array(Image.open(run_dir / "images/eval/a/grey/00000005.png")), pixels(grey))


# ---- without the extras ----------------------------------------------------------------------------


@pytest.mark.slow
def test_listing_plugins_and_checking_a_csv_recipe_import_neither_tracker(write_recipe):
    """`eblvm plugins` lists the trackers and `eblvm validate` checks a recipe without importing wandb or mlflow."""
    recipe = write_recipe(SMALL_RECIPE + LOG["csv"])
    script = f"""
import sys
from typer.testing import CliRunner
from eblvm_core.cli import app
listing = CliRunner().invoke(app, ["plugins"])
checked = CliRunner().invoke(app, ["validate", {str(recipe)!r}])
assert listing.exit_code == 0 and checked.exit_code == 0, (listing.output, checked.output)
assert all(name in listing.output for name in ("csv", "wandb", "mlflow")), listing.output
print(sorted(m for m in ("wandb", "mlflow") if m in sys.modules))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("kind", ["wandb", "mlflow"])
def test_a_tracker_whose_extra_is_missing_is_refused_in_one_line(cli, write_recipe, tmp_path, monkeypatch, kind):
    import importlib.util

    from eblvm_core.plugins import install_hint

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == kind else real(name, *a))
    recipe = write_recipe(SMALL_RECIPE + LOG["csv"] + LOG[kind])
    hint = install_hint(kind)  # pip install -e ".[wandb]" in a checkout, pip install "eblvm[wandb]" otherwise
    expected = f"r.toml: [log.1] kind: the {kind} logger needs the {kind} package: {hint}"
    for command in (["validate", recipe], ["run", recipe, "--out", tmp_path / "runs"]):
        result = cli(command)
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].endswith(expected), result.output
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("recipe.toml"))


@pytest.mark.parametrize("name", ["csv", "wandb", "mlflow"])
def test_the_logger_contract(name, tmp_path, request):
    if name != "csv":
        request.getfixturevalue(f"{name}_env")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    testing.check_logger(testing.make("loggers", name, run_dir), run_dir)


# ---- Weights & Biases, offline ---------------------------------------------------------------------


@pytest.fixture
def wandb_env(monkeypatch, tmp_path):
    """wandb installed, offline, with every folder of its own in tmp_path and no credentials."""
    wandb = pytest.importorskip("wandb")
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_ENTITY", "WANDB_PROJECT"):
        monkeypatch.delenv(var, raising=False)
    for var in ("WANDB_RUN_ID", "WANDB_RESUME", "WANDB_NAME", "WANDB_TAGS", "WANDB_RUN_GROUP", "WANDB_NOTES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    wandb.teardown()  # wandb reads its environment once per process: start from this one
    yield wandb
    wandb.teardown()


def wandb_records(run_folder: Path) -> list:
    """The records of an offline run's .wandb file (a LevelDB-style log of protobuf records:
    32 KiB blocks, a 7-byte header per fragment, after the file's own 7-byte header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(str(run_folder / "run-*.wandb"))
    raw, records, parts, pos = Path(path).read_bytes(), [], b"", 7
    while pos + 7 <= len(raw):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        data, pos = raw[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            parts = data
        elif kind in (3, 4):
            parts += data
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            records.append(record)
    return records


def wandb_read(run_folder: Path) -> dict:
    """What an offline run holds: its run record, config, history rows and exit code."""
    out: dict = {"history": [], "config": {}, "files": [], "exit": None, "run": None, "metrics": []}
    for record in wandb_records(run_folder):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["run"] = record.run
            out["config"].update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            out["config"].update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            out["history"].append({k: v for k, v in row.items() if not k.startswith("_")})
        elif kind == "files":
            out["files"] += [f.path for f in record.files.files]
        elif kind == "metric":
            out["metrics"].append((record.metric.name or record.metric.glob_name, record.metric.step_metric))
        elif kind == "exit":
            out["exit"] = record.exit.exit_code
    return out


def offline_runs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*"))


def test_wandb_offline_run_holds_the_scalars_images_config_and_recipe(cli, write_recipe, tmp_path, wandb_env):
    run_dir = train(cli, write_recipe, tmp_path, SMALL_RECIPE + IMAGES + LOG["wandb"] + 'tags = ["t1"]\n')
    (folder,) = offline_runs(run_dir)
    held = wandb_read(folder)
    run_id = json.loads((run_dir / "wandb" / "eblvm-run.json").read_text())["id"]
    assert held["run"].run_id == run_id and folder.name.endswith(run_id)
    assert held["run"].display_name == f"small/{run_dir.name}" and held["run"].project == "eblvm"
    assert list(held["run"].tags) == ["t1"]
    assert ("*", "step") in held["metrics"]  # every chart's x-axis is the optimizer step
    scalars = [row for row in held["history"] if not any(k.endswith("/_type") for k in row)]
    images = [row for row in held["history"] if any(k.endswith("/_type") for k in row)]
    expected = jsonl_rows(run_dir)
    assert len(scalars) == len(expected) and all(
        same({k: float(v) for k, v in a.items()}, b) for a, b in zip(scalars, expected)
    )
    assert [(row["step"], row["eval/density-plot/density/_type"]) for row in images] == [(30, "image-file")]
    assert (folder / "files" / images[0]["eval/density-plot/density/path"]).is_file()
    recipe = tomllib.loads((run_dir / "recipe.toml").read_text())
    assert {key: held["config"][key] for key in recipe} == recipe
    assert (
        "recipe.toml" in held["files"]
        and (folder / "files" / "recipe.toml").read_text() == (run_dir / "recipe.toml").read_text()
    )
    assert held["exit"] == 0


def test_wandb_resumed_run_continues_the_same_run(cli, write_recipe, tmp_path, wandb_env):
    run_dir = train(cli, write_recipe, tmp_path, SMALL_RECIPE + LOG["wandb"], "run.steps=20")
    resume(cli, run_dir, "run.steps=30")
    first, second = (wandb_read(folder) for folder in offline_runs(run_dir))
    assert first["run"].run_id == second["run"].run_id
    assert [row["step"] for row in first["history"]] == [10, 20, 20]  # training, then the final evaluation
    assert [row["step"] for row in second["history"]] == [30, 30]
    assert second["config"]["run"]["steps"] == 30 and first["exit"] == second["exit"] == 0


def test_wandb_without_a_server_falls_back_to_offline(cli, write_recipe, tmp_path, wandb_env, monkeypatch):
    """An API key but no server (a closed local port): the run starts offline after init_timeout."""
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef0123456789abcdef01234567")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    wandb_env.teardown()
    recipe = write_recipe(SMALL_RECIPE + LOG["wandb"] + "init_timeout = 2.0\n")
    result = cli(["run", recipe, "--out", tmp_path / "runs"])
    assert result.exit_code == 0, result.output
    assert "wandb: cannot start an online run" in result.output
    (folder,) = offline_runs(only_run_dir(tmp_path / "runs"))
    held = wandb_read(folder)
    assert [row["step"] for row in held["history"]] == [10, 20, 30, 30] and held["exit"] == 0


def test_wandb_mode_follows_wandb_mode_then_the_recipe_then_the_credentials(monkeypatch, tmp_path):
    pytest.importorskip("wandb")
    from eblvm_trackers.wandb_logger import pick_mode

    url = "https://api.wandb.ai"
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_IDENTITY_TOKEN_FILE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert pick_mode("online", url) == ("offline", None)
    monkeypatch.delenv("WANDB_MODE")
    assert pick_mode("online", url) == ("online", None)
    assert pick_mode("auto", url)[0] == "offline"
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password " + "a" * 40 + "\n")
    assert pick_mode("auto", url) == ("online", None)
    (tmp_path / "netrc").write_text("machine example.com login user password x\n")
    monkeypatch.setenv("WANDB_API_KEY", "a" * 40)
    assert pick_mode("auto", url) == ("online", None)


# ---- MLflow ------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def mlflow_cache(tmp_path_factory):
    """One user cache for the session's MLflow tests: the empty database is set up once."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def mlflow_env(monkeypatch, mlflow_cache):
    mlflow = pytest.importorskip("mlflow")
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(mlflow_cache))
    return mlflow


def mlflow_run(run_dir: Path):
    from mlflow import MlflowClient

    saved = json.loads((run_dir / "mlflow" / "eblvm-run.json").read_text())
    client = MlflowClient(tracking_uri=saved["tracking_uri"])
    return client, client.get_run(saved["run_id"])


def test_mlflow_run_holds_metrics_params_images_and_recipe(cli, write_recipe, tmp_path, mlflow_env):
    from eblvm_core.recipe import load_recipe
    from eblvm_core.rundir import hyperparameters

    run_dir = train(cli, write_recipe, tmp_path, SMALL_RECIPE + IMAGES + LOG["mlflow"] + 'tags = {team = "x"}\n')
    client, run = mlflow_run(run_dir)
    assert run.info.status == "FINISHED" and run.info.run_name == f"small/{run_dir.name}"
    assert run.data.tags["team"] == "x"
    expected = jsonl_rows(run_dir)
    for key in first_appearance(expected)[1:]:
        held = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        assert sorted(held) == [(row["step"], row[key]) for row in expected if key in row], key
    hparams = hyperparameters(load_recipe(run_dir / "recipe.toml"))
    assert run.data.params == {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in hparams.items()}
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert "recipe.toml" in artifacts
    recipe = Path(client.download_artifacts(run.info.run_id, "recipe.toml", str(tmp_path)))
    assert recipe.read_text() == (run_dir / "recipe.toml").read_text()
    images = [a.path for a in client.list_artifacts(run.info.run_id, "images")]
    assert any("density-plot" in p and "+step+30+" in p and p.endswith(".png") for p in images), images


def test_mlflow_resumed_run_continues_the_same_run_and_keeps_its_params(cli, write_recipe, tmp_path, mlflow_env):
    run_dir = train(cli, write_recipe, tmp_path, SMALL_RECIPE + LOG["mlflow"], "run.steps=20")
    first = mlflow_run(run_dir)[1].info.run_id
    resume(cli, run_dir, "run.steps=30")
    client, run = mlflow_run(run_dir)
    assert run.info.run_id == first and run.info.status == "FINISHED"
    assert run.data.params["run.steps"] == "20" and run.data.tags["resumed.run.steps"] == "30"
    assert [m.step for m in client.get_metric_history(first, "train/loss")] == [10, 20, 30]
    assert [m.step for m in client.get_metric_history(first, "eval/exact-loglik/test_loglik")] == [20, 30]


def test_mlflow_cuts_long_params_and_marks_a_run_that_stopped_early(tmp_path, mlflow_env):
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    (tmp_path / "recipe.toml").write_text(f'[data]\nroot = "{"d" * (MAX_PARAM_VAL_LENGTH + 10)}"\n[model]\nk = 4\n')
    logger = testing.make("loggers", "mlflow", tmp_path)
    logger.log_scalars(3, {"train/loss": float("nan")})
    logger.close()  # never told the run finished
    client, run = mlflow_run(tmp_path)
    root = run.data.params["data.root"]
    assert len(root) == MAX_PARAM_VAL_LENGTH and root.endswith("(cut; see recipe.toml)") and root.startswith("ddd")
    assert run.data.params["model.k"] == "4" and run.info.status == "KILLED"
    (point,) = client.get_metric_history(run.info.run_id, "train/loss")
    assert point.step == 3 and math.isnan(point.value)


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_tracker_that_cannot_record_does_not_stop_training(name, tmp_path, request, monkeypatch, capsys):
    request.getfixturevalue(f"{name}_env")
    logger = testing.make("loggers", name, tmp_path)
    target, method = (logger.run, "log") if name == "wandb" else (logger.client, "log_batch")

    def refuse(*_args, **_kwargs):
        raise RuntimeError("the server is gone")

    with monkeypatch.context() as patch:
        patch.setattr(target, method, refuse)
        logger.log_scalars(1, {"train/loss": 1.0})
        logger.log_scalars(2, {"train/loss": 2.0})
        logger.log_hparams({"model.k": 4}, {"eval/x/y": 2.0})
    logger.close()
    err = capsys.readouterr().err
    assert err.count("training goes on") == 1 and f"{name}: logging step 1 failed (the server is gone)" in err
