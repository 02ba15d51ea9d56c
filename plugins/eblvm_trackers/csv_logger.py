"""The CSV sink: every recorded row of scalars in one wide table, ``<run_dir>/metrics.csv``."""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any

import attrs
from torch import Tensor

from eblvm_core.plugin_api import METRICS, Logger, option

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


class CSVLogger(Logger):
    """One row per record (the rows of metrics.jsonl that training and evaluation write): a ``step``
    column, then one column per scalar key in the order the keys first appear; a key a row lacks is
    an empty cell. A new key rewrites the file (atomically) with the wider header; other rows are
    appended. Images and hyper-parameters are not written (recipe.toml holds the latter)."""

    def __init__(self, cfg: CSVConfig, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / cfg.file
        self.columns = self._read()[0] if self.path.exists() else []

    def _read(self) -> tuple[list[str], list[dict[str, str]]]:
        """(header, rows as column -> cell); a last line cut by a kill is left out."""
        text = self.path.read_text(encoding="utf-8")
        if not text.endswith("\n"):
            text = text[: text.rfind("\n") + 1]
        lines = list(csv.reader(io.StringIO(text, newline="")))
        if not lines:
            return [], []
        header = lines[0]
        return header, [dict(zip(header, line)) for line in lines[1:]]

    def _rewrite(self, columns: list[str], rows: list[dict[str, str]]) -> None:
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows([row.get(c, "") for c in columns] for row in rows)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(out.getvalue(), encoding="utf-8")
        os.replace(tmp, self.path)
        self.columns = columns

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        row = {"step": str(int(step)), **{key: cell(value) for key, value in scalars.items()}}
        if any(key not in self.columns for key in row):
            header, rows = self._read() if self.path.exists() else ([], [])
            columns = header or ["step"]
            self._rewrite(columns + [key for key in row if key not in columns], [*rows, row])
            return
        with open(self.path, "a", encoding="utf-8", newline="") as fh:
            csv.writer(fh, lineterminator="\n").writerow([row.get(c, "") for c in self.columns])

    def log_images(self, step: int, images: dict[str, Tensor]) -> None:
        """Images are not written to the table."""

    def resume(self, step: int, final_pending: bool | None = None) -> None:
        """Drop the rows an earlier session wrote after the checkpoint at ``step`` (the resumed run
        writes them again), and the evaluation rows at ``step`` when the final evaluation runs again
        there (``final_pending``): the rule the core applies to metrics.jsonl, which it has applied
        before this call; without ``final_pending`` the CSV follows what metrics.jsonl kept at
        ``step``. Columns only dropped rows used go too."""
        if not self.path.exists():
            return
        header, rows = self._read()
        if final_pending is None:
            final_pending = not self._evaluated_in_jsonl(step)

        def rerun(row: dict[str, str]) -> bool:
            try:
                at = int(row.get("step", ""))
            except ValueError:
                return True  # not a row this logger wrote whole
            evaluated = any(value and key.startswith("eval/") for key, value in row.items())
            return at > step or (final_pending and at == step and evaluated)

        kept = [row for row in rows if not rerun(row)]
        self._rewrite([c for c in header if c == "step" or any(row.get(c) for row in kept)], kept)

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
    """Scalars of every training and evaluation record in one CSV table, <run_dir>/metrics.csv: a
    step column and one column per key (pandas.read_csv reads it; nan and inf as such)."""
    return CSVLogger(config, run_dir)
