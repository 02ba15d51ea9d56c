"""A process's start without Python's cyclic garbage collector.

Importing torch and ``torch._dynamo`` makes some 300,000 objects the collector tracks, which live
as long as the process. Collected as they come, and once more at exit, they cost a small ``eblvm
run`` a quarter of its CPU time (docs/benchmarks.md, "Starting a process"). The commands that
build (run, eval, sample, validate) run in ``paused_gc``, and a pool's worker process starts with
``pause_gc``; making a run's first parts (its data and networks, to plan or to build) calls
``resume_gc``, which imports what torch.optim would import on its first call, freezes every object
that exists by then (``gc.freeze``: left out of every later collection) and turns collection back
on. What the build makes is collected as usual. Without a pause (eblvm used as a library)
``resume_gc`` does nothing."""

from __future__ import annotations

import contextlib
import gc
import importlib
from collections.abc import Iterator

_paused = False


def pause_gc() -> None:
    """Turn automatic collection off until ``resume_gc``; nothing if it is off already."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume_gc() -> None:
    """End ``pause_gc``'s pause: import ``torch._dynamo`` (torch.optim imports it on its first call,
    through ``torch._disable_dynamo``), freeze the objects that exist and turn collection on.
    Nothing without a pause, and nothing the second time."""
    global _paused
    if _paused:
        importlib.import_module("torch._dynamo")
        gc.freeze()
        gc.enable()
        _paused = False


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """``pause_gc`` for a command's body; collection is on again at its end even where nothing was
    built (an error before the build). The frozen objects stay frozen."""
    global _paused
    pause_gc()
    try:
        yield
    finally:
        if _paused:
            gc.enable()
            _paused = False
