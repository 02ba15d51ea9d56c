"""Errors a user can act on; the CLI prints them as one line and exits with the error's
``exit_code``: 2 for a wrong recipe, override or file given (the default), 3 when training
diverged, 130 when interrupted, 1 when the file system refused a write."""

from __future__ import annotations

from collections.abc import Sequence


class EblvmError(Exception):
    """Base of errors shown to the user without a traceback."""

    exit_code = 2

    def __reduce__(self) -> tuple:
        """Pickle by state, whatever the constructor takes: an error raised in a worker process
        (``eblvm compare --jobs N``) reaches the parent intact and prints as one line there."""
        return _restore, (type(self), self.args, self.__dict__)


def _restore(cls: type[EblvmError], args: tuple, state: dict) -> EblvmError:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class ConfigError(EblvmError):
    """A recipe value is wrong. ``file`` is filled in by the recipe loader when known.

    Printed as ``file: [section] key: message``, leaving out what is unknown.
    """

    def __init__(self, section: str, key: str | None, message: str, file: str | None = None):
        super().__init__(message)
        self.section, self.key, self.message, self.file = section, key, message, file

    def __str__(self) -> str:
        where = " ".join(filter(None, [f"[{self.section}]" if self.section else "", self.key or ""]))
        return ": ".join(filter(None, [self.file or "", where, self.message]))

    @property
    def errors(self) -> list[ConfigError]:
        """The single errors this one holds: itself (``ConfigErrors``: each of several)."""
        return [self]

    @staticmethod
    def combine(errors: list[ConfigError]) -> ConfigError:
        """One error for ``errors`` (ConfigErrors flattened): the error itself when there is one,
        else a ``ConfigErrors`` holding them in order."""
        flat = [single for error in errors for single in error.errors]
        return flat[0] if len(flat) == 1 else ConfigErrors(flat)


class ConfigErrors(ConfigError):
    """Several ConfigErrors found together (every bad key of a recipe), printed one line each.
    ``errors`` lists them; ``section``, ``key`` and ``message`` are the first's; setting ``file``
    (or ``section``) sets it on each that has none yet."""

    def __init__(self, errors: list[ConfigError]):
        first = errors[0]
        self.__dict__["all"] = list(errors)
        super().__init__(first.section, first.key, first.message, first.file)

    def __setattr__(self, name: str, value: object) -> None:
        super().__setattr__(name, value)
        if name in ("file", "section") and value:
            for error in self.__dict__.get("all", []):
                setattr(error, name, getattr(error, name) or value)

    @property
    def errors(self) -> list[ConfigError]:
        return list(self.__dict__["all"])

    def __str__(self) -> str:
        return "\n".join(str(error) for error in self.__dict__["all"])


class DataError(EblvmError):
    """A dataset file or folder is missing or malformed; ``key`` is the [data] key that points at it."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


class CheckpointError(EblvmError):
    """A checkpoint file is missing, corrupt or belongs to another recipe: ``file: message``."""

    def __init__(self, file: str, message: str):
        super().__init__(f"{file}: {message}")
        self.file = file


class TrainingDiverged(EblvmError):
    """A loss, a parameter or an evaluation became NaN or infinite; the run stopped."""

    exit_code = 3


class Interrupted(EblvmError):
    """Ctrl-C or SIGTERM: the run wrote a checkpoint and stopped."""

    exit_code = 130


class FileSystemError(EblvmError):
    """The run directory could not be written (read-only, full, missing permissions)."""

    exit_code = 1


# ---- which -o value an error comes from ----------------------------------------------------------


def override_path(override: str) -> str | None:
    """The dotted recipe path an ``-o`` value sets (``optim.model.lr``) or drops (``~eval.1`` ->
    ``eval.1``); None for text that is neither."""
    text = override.strip()
    if text.startswith("~"):
        return text[1:].strip() or None
    path, sep, _value = text.partition("=")
    return (path.strip() or None) if sep else None


def caused_by(error: ConfigError, overrides: Sequence[str]) -> str | None:
    """The last of ``overrides`` that set or dropped the section and key ``error`` names (or, for
    an error about a whole section or list item, something inside it), else None."""
    where = ".".join(filter(None, [error.section, error.key]))
    if not where:
        return None
    for override in reversed(overrides):
        path = override_path(override)
        if path is None:
            continue
        drop = override.strip().startswith("~")
        if where == path or (not drop and where.startswith(path + ".")):
            return override
        if error.key is None and not drop and path.startswith(where + "."):
            return override
    return None


def blame(exc: ConfigError, overrides: Sequence[str], file: str | None = None) -> None:
    """Name the ``-o`` value as the file of each error of ``exc`` it caused (``caused_by``)
    where the error names ``file`` or no file yet: ``-o run.stepz=3: [run] stepz: unknown key``."""
    for error in exc.errors:
        if error.file in (None, file):
            source = caused_by(error, overrides)
            if source is not None:
                error.file = f"-o {source}"


def from_override(exc: ConfigError, override: str) -> ConfigError:
    """An error ``apply_override`` raised, as an error of the ``-o`` value: named ``-o VALUE``, its
    message without the "override 'VALUE'" it began with."""
    for error in exc.errors:
        error.file = f"-o {override}"
        for prefix in (f"override '{override}': ", f"override '{override}' "):
            error.message = error.message.removeprefix(prefix)
    return exc
