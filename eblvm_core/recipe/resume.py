"""What may change between a run's recipe and the one that resumes or evaluates it
(``RESUMABLE``), and what a checkpoint was trained by (``training_part``)."""

from __future__ import annotations

from typing import Any

from eblvm_core.errors import ConfigError
from eblvm_core.recipe.schema import Recipe

# Keys that may differ between a run's recipe and a resumed (or evaluated) one: how long to train
# (steps, and the patience of early stopping), how often to log, evaluate and checkpoint, where (device, threads, the data folder), and what
# to evaluate and where to log. Everything else decides what is trained and is fixed for a run.
RESUMABLE = (
    "run.steps",
    "run.log_every",
    "run.eval_every",
    "run.checkpoint_every",
    "run.keep_every",
    "run.patience",
    "run.threads",
    "run.device",
    "run.cuda_graph",
    "run.cudnn_benchmark",
    "run.compile",
    "data.root",
    "eval",
    "log",
)


def _resumable(path: str) -> bool:
    return any(path == key or path.startswith(key + ".") for key in RESUMABLE)


def differences(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted path, value in a, value in b) wherever two resolved recipe dicts differ; None for absent."""
    if isinstance(a, dict) and isinstance(b, dict):
        found = []
        for key in [*a, *(k for k in b if k not in a)]:
            found += differences(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else str(key))
        return found
    return [] if a == b else [(prefix, a, b)]


def training_part(resolved: dict[str, Any]) -> dict[str, Any]:
    """A resolved recipe (``Recipe.to_dict()``) without the RESUMABLE keys: what a checkpoint was trained by."""

    def keep(node: Any, prefix: str) -> Any:
        if not isinstance(node, dict):
            return node
        return {
            k: keep(v, f"{prefix}.{k}" if prefix else k)
            for k, v in node.items()
            if not _resumable(f"{prefix}.{k}" if prefix else k)
        }

    return keep(resolved, "")


def _split(path: str) -> tuple[str, str]:
    section, _, key = path.rpartition(".")
    return section, key


def check_unchanged(before: Recipe, after: Recipe, when: str, also: tuple[str, ...] = ()) -> None:
    """Refuse ``after`` (the run's recipe with overrides) where it differs from ``before`` outside
    RESUMABLE and the sections ``also``: a ConfigError naming the first such key."""
    for path, old, new in differences(before.to_dict(), after.to_dict()):
        if not _resumable(path) and not any(path == key or path.startswith(key + ".") for key in also):
            section, key = (path, None) if isinstance(old, dict) or isinstance(new, dict) else _split(path)
            allowed = ", ".join((*RESUMABLE, *also))
            error = ConfigError(
                section,
                key,
                f"cannot change {when} (the run has {old!r}, the override gives {new!r}); what may change: {allowed}",
            )
            after.blame(error)
            raise error
