"""The CSV logger writes one row per (step, checkpoint), in step order: a step's training means and
its evaluation share a row; `eblvm eval` of a checkpoint gets a row of its own, named in the
`checkpoint` column (empty for training), placed at its step even when written later; after a
resume, and after evaluating one checkpoint twice, each (step, checkpoint) still appears once.
The rows are metrics.jsonl's rows merged by (step, checkpoint), readable by `csv` and pandas."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from eblvm import testing
from tests.support import SMALL_RECIPE, only_run_dir

CSV = SMALL_RECIPE + '\n[[log]]\nkind = "csv"\n'


def ok(result) -> None:
    assert result.exit_code == 0, result.output


def csv_table(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        rows = list(reader)
    return list(reader.fieldnames or []), rows


def merged_jsonl(run_dir: Path) -> list[tuple[int, str, dict[str, float]]]:
    """metrics.jsonl merged by (step, checkpoint), sorted by step (training first at a step)."""
    merged: dict[tuple[int, str], dict[str, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        key = (row.pop("step"), row.pop("checkpoint", ""))
        bad = row.pop("nonfinite", {})
        merged.setdefault(key, {}).update({k: float(bad[k]) if v is None else float(v) for k, v in row.items()})
    order = sorted(merged, key=lambda key: (key[0], key[1] != ""))
    return [(step, checkpoint, merged[step, checkpoint]) for step, checkpoint in order]


def as_read(rows: list[dict[str, str]]) -> list[tuple[int, str, dict[str, float]]]:
    return [
        (int(r["step"]), r["checkpoint"], {k: float(v) for k, v in r.items() if k not in ("step", "checkpoint") and v})
        for r in rows
    ]


def test_one_row_per_step_and_checkpoint_in_step_order(cli, write_recipe, tmp_path):
    out = tmp_path / "runs"
    options = ["-o", "run.eval_every=10", "-o", "run.keep_every=10"]
    ok(cli(["run", write_recipe(CSV), "--out", out, *options]))
    run_dir = only_run_dir(out)
    header, rows = csv_table(run_dir / "metrics.csv")
    assert header[:2] == ["step", "checkpoint"]
    assert [(r["step"], r["checkpoint"]) for r in rows] == [("10", ""), ("20", ""), ("30", "")]
    assert all(r["train/loss"] and r["eval/exact-loglik/test_loglik"] for r in rows)  # training and eval: one row

    ok(cli(["eval", run_dir]))  # the last checkpoint, step 30
    ok(cli(["eval", run_dir, "--checkpoint", "step:10"]))  # written later, placed at its step
    ok(cli(["eval", run_dir, "--checkpoint", "step:10", "-e", "score-loss"]))  # the same checkpoint: its row grows
    header, rows = csv_table(run_dir / "metrics.csv")
    assert [(r["step"], r["checkpoint"]) for r in rows] == [
        ("10", ""),
        ("10", "step:10"),
        ("20", ""),
        ("30", ""),
        ("30", "last"),
    ]
    assert rows[1]["eval/exact-loglik/test_loglik"] == rows[0]["eval/exact-loglik/test_loglik"]  # same parameters
    assert rows[1]["eval/score-loss/test_score_loss"] and not rows[1]["train/loss"]
    assert as_read(rows) == merged_jsonl(run_dir)


def test_after_a_resume_each_step_appears_once(cli, write_recipe, tmp_path):
    out = tmp_path / "runs"
    ok(cli(["run", write_recipe(CSV), "--out", out, "-o", "run.steps=20", "-o", "run.eval_every=10"]))
    run_dir = only_run_dir(out)
    ok(cli(["eval", run_dir]))  # (20, last): kept across the resume, as metrics.jsonl keeps it
    ok(cli(["run", "--resume", run_dir, "-o", "run.steps=30"]))
    _, rows = csv_table(run_dir / "metrics.csv")
    assert [(r["step"], r["checkpoint"]) for r in rows] == [("10", ""), ("20", ""), ("20", "last"), ("30", "")]
    assert as_read(rows) == merged_jsonl(run_dir)


def test_a_resumed_csv_drops_later_steps_and_a_rerun_final_evaluation_but_keeps_eval_rows(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text(
        "step,checkpoint,a,eval/x\n5,,1.0,\n10,,2.0,0.5\n10,last,,0.6\n15,,3.0,\n15,best,,0.7\n2"
    )  # killed while writing step 20
    logger = testing.make("loggers", "csv", tmp_path)
    logger.resume(10, final_pending=False)
    assert path.read_text() == "step,checkpoint,a,eval/x\n5,,1.0,\n10,,2.0,0.5\n10,last,,0.6\n15,best,,0.7\n"
    logger.resume(10, final_pending=True)  # the final evaluation at 10 runs again: its cells go, the row stays
    assert path.read_text() == "step,checkpoint,a,eval/x\n5,,1.0,\n10,,2.0,\n10,last,,0.6\n15,best,,0.7\n"
    logger.log_scalars(10, {"eval/x": 0.55})
    logger.log_scalars(15, {"a": 3.5})
    assert path.read_text() == (
        "step,checkpoint,a,eval/x\n5,,1.0,\n10,,2.0,0.55\n10,last,,0.6\n15,,3.5,\n15,best,,0.7\n"
    )


def test_pandas_reads_the_table_with_its_checkpoint_column(tmp_path):
    pandas = pytest.importorskip("pandas")
    logger = testing.make("loggers", "csv", tmp_path)
    logger.log_scalars(1, {"a": 0.1})
    logger.log_scalars(1, {"eval/x": float("nan")})
    logger.log_evaluation(1, {"eval/x": 2.0}, "step:1")
    logger.log_scalars(2, {"a": float("inf")})
    frame = pandas.read_csv(tmp_path / "metrics.csv")
    assert list(frame.columns) == ["step", "checkpoint", "a", "eval/x"]
    assert frame["step"].tolist() == [1, 1, 2] and frame["checkpoint"].fillna("").tolist() == ["", "step:1", ""]
    assert frame["a"][0] == 0.1 and math.isnan(frame["eval/x"][0]) and frame["eval/x"][1] == 2.0
    assert frame["a"][2] == math.inf
