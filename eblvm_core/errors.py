"""Errors a user can act on; the CLI prints them as one line and exits with code 2."""

from __future__ import annotations


class EblvmError(Exception):
    """Base of errors shown to the user without a traceback."""


class ConfigError(EblvmError):
    """A recipe value is wrong. ``file`` is filled in by the recipe loader when known."""

    def __init__(self, section: str, key: str | None, message: str, file: str | None = None):
        super().__init__(message)
        self.section, self.key, self.message, self.file = section, key, message, file

    def __str__(self) -> str:
        where = f"[{self.section}]" if self.section else ""
        if self.key:
            where += f" {self.key}"
        prefix = f"{self.file}: " if self.file else ""
        return f"{prefix}{where}: {self.message}".strip()


class DataError(EblvmError):
    """A dataset file or folder is missing or malformed."""


class TrainingDiverged(EblvmError):
    """The loss became NaN or infinite; the run stopped."""
