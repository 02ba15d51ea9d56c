"""The CSV sink: the scalars of metrics.jsonl in one wide table, ``<run_dir>/metrics.csv``, one row per
(step, checkpoint) in step order."""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any

import attrs
from torch import Tensor

from eblvm.plugin import Logger, option
from eblvm.tools import METRICS

from .common import resolved_recipe


def plain_file_name(_inst: Any, _attr: Any, value: str) -> None:
    if not value or value in (".", "..") or "/" in value or "\\" in value:
        raise ValueError(f"must be a plain file name inside the run directory, got {value!r}")


@attrs.frozen
class CSVConfig:
    file: str = option("metrics.csv", "file name inside the run directory", plain_file_name)


def cell(value: Any) -> str:
    """A scalar as CSV text: integers as they are, floats by ``repr`` (shortest text that reads back
    exactly), non-finite values as nan, inf and -inf, which pandas and ``float()`` read back."""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


KEYS = ["step", "checkpoint"]  # a row's identity, the first two columns


def order(row: dict[str, str]) -> tuple[int, bool]:
    """Where a row goes: by step, the training row (no checkpoint) before evaluations of a checkpoint."""
    try:
        step = int(row.get("step", ""))
    except ValueError:
        step = -1
    return step, bool(row.get("checkpoint"))


def identity(row: dict[str, str]) -> tuple[str, str]:
    return row.get("step", ""), row.get("checkpoint", "")


class CSVLogger(Logger):
    """One row per (step, checkpoint), in step order: ``step``, ``checkpoint`` (empty for what
    training recorded; ``last``, ``best``, ``step:N`` or a file for ``eblvm eval``, as in
    metrics.jsonl), then one column per scalar key in the order the keys first appear; a key a
    row lacks is an empty cell. A step's training means and its evaluation share a row (the rows
    of metrics.jsonl merged by step and checkpoint); an evaluation of a checkpoint goes to its
    step's place, after the training row, however late it is written. A row after the last is
    appended; a new key, a row that grows or one that goes before the last rewrite the file
    (atomically). Images and hyper-parameters are not written (recipe.toml holds the latter)."""

    def __init__(self, cfg: CSVConfig, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / cfg.file
        self._remember(*self._read())

    def _read(self) -> tuple[list[str], list[dict[str, str]]]:
        """(header, rows as column -> cell, merged by (step, checkpoint)); a last line cut by a
        kill is left out; a file without a checkpoint column (older eblvm) reads as training rows."""
        if not self.path.exists():
            return [], []
        text = self.path.read_text(encoding="utf-8")
        if not text.endswith("\n"):
            text = text[: text.rfind("\n") + 1]
        lines = list(csv.reader(io.StringIO(text, newline="")))
        if not lines:
            return [], []
        header = lines[0]
        rows: dict[tuple[str, str], dict[str, str]] = {}
        for line in lines[1:]:
            row = {"checkpoint": "", **dict(zip(header, line))}
            merged = rows.setdefault(identity(row), {})
            merged.update({k: v for k, v in row.items() if v or k not in merged})
        return header, list(rows.values())

    def _remember(self, header: list[str], rows: list[dict[str, str]]) -> None:
        """What the file holds: its header, its rows' identities and the place of its last row."""
        self.columns = header
        self.keys = {identity(row) for row in rows}
        self.last = order(rows[-1]) if rows else None

    def _rewrite(self, columns: list[str], rows: list[dict[str, str]]) -> None:
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows([row.get(c, "") for c in columns] for row in rows)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(out.getvalue(), encoding="utf-8")
        os.replace(tmp, self.path)
        self._remember(columns, rows)

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        """What training records at ``step``: its row (checkpoint empty)."""
        self._log(step, "", scalars)

    def log_evaluation(self, step: int, scalars: dict[str, float], checkpoint: str) -> None:
        """``eblvm eval`` of ``checkpoint`` (at ``step``): the row (step, checkpoint)."""
        self._log(step, checkpoint, scalars)

    def _log(self, step: int, checkpoint: str, scalars: dict[str, float]) -> None:
        row = {"step": str(int(step)), "checkpoint": checkpoint, **{key: cell(value) for key, value in scalars.items()}}
        new = [key for key in row if key not in self.columns]
        after = self.last is None or order(row) >= self.last
        if not new and self.columns[:2] == KEYS and identity(row) not in self.keys and after:
            with open(self.path, "a", encoding="utf-8", newline="") as fh:
                csv.writer(fh, lineterminator="\n").writerow([row.get(c, "") for c in self.columns])
            self.keys.add(identity(row))
            self.last = order(row)
            return
        header, rows = self._read()  # the file as it is now (an eblvm eval may have written to it)
        columns = KEYS + [c for c in [*header, *row] if c not in KEYS]
        same = next((r for r in rows if identity(r) == identity(row)), None)
        if same is not None:
            same.update(row)
        else:
            rows.append(row)
        rows.sort(key=order)  # stable: evaluations of one step stay in the order they came
        self._rewrite(list(dict.fromkeys(columns)), rows)

    def log_images(self, step: int, images: dict[str, Tensor]) -> None:
        """Images are not written to the table."""

    def resume(self, step: int, final_pending: bool | None = None) -> None:
        """Drop what an earlier session's training wrote after the checkpoint at ``step`` (the
        resumed run writes it again), and the evaluation cells of the row at ``step`` when the
        final evaluation runs again there (``final_pending``): the rule the core applies to
        metrics.jsonl, which it has applied before this call; without ``final_pending`` the CSV
        follows what metrics.jsonl kept at ``step``. Rows of ``eblvm eval`` (a checkpoint named)
        stay, as in metrics.jsonl. Columns only dropped cells used go too."""
        if not self.path.exists():
            return
        header, rows = self._read()
        if final_pending is None:
            final_pending = not self._evaluated_in_jsonl(step)
        kept = []
        for row in rows:
            at = order(row)[0]
            if row["checkpoint"]:
                kept.append(row)
            elif 0 <= at < step or (at == step and not final_pending):
                kept.append(row)
            elif at == step:  # the final evaluation runs again: its cells go, the training means stay
                row = {k: v for k, v in row.items() if not k.startswith("eval/")}
                if any(v for k, v in row.items() if k not in KEYS):
                    kept.append(row)
        columns = KEYS + [c for c in header if c not in KEYS and any(row.get(c) for row in kept)]
        self._rewrite(columns, kept)

    def _evaluated_in_jsonl(self, step: int) -> bool:
        """Whether metrics.jsonl (cleaned by the core for this resume) still holds an evaluation row of
        training at ``step``; when it cannot be read, whether ``step`` is not the run's last."""
        try:
            lines = (self.run_dir / METRICS).read_text().splitlines()
        except OSError:
            return resolved_recipe(self.run_dir).get("run", {}).get("steps") != step
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("step") == step and "checkpoint" not in row and any(k.startswith("eval/") for k in row):
                return True
        return False


def build_csv(config: CSVConfig, run_dir: Path) -> CSVLogger:
    """Scalars of every training and evaluation record in one CSV table, <run_dir>/metrics.csv: one
    row per (step, checkpoint) in step order, step and checkpoint columns and one column per key
    (pandas.read_csv reads it; nan and inf as such)."""
    return CSVLogger(config, run_dir)
