"""A process's start without Python's cyclic garbage collector.

Importing torch and ``torch._dynamo`` makes some 300,000 objects the collector tracks, which live
as long as the process. Collected as they come, and once more at exit, they cost a small ``eblvm
run`` a quarter of its CPU time (docs/benchmarks.md, "Starting a process"). The commands that
build (run, eval, sample, validate) run in ``paused_gc``, and a pool's worker process starts with
``pause_gc``; making a run's first parts (its data and networks, to plan or to build) calls
``resume_gc``, which imports what torch.optim would import on its first call, freezes every object
that exists by then (``gc.freeze``: left out of every later collection) and turns collection back
on. What the build makes is collected as usual. Without a pause (eblvm used as a library)
``resume_gc`` does nothing.

A pool of run workers (``worker_pool``) forks its workers from one server process that has
imported torch once (``eblvm_core.worker_imports``), where the platform has a fork server."""

from __future__ import annotations

import contextlib
import gc
import importlib
import multiprocessing
import os
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

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


def worker_pool(workers: int) -> ProcessPoolExecutor:
    """A pool of ``workers`` processes that train runs (``eblvm compare --jobs``, ``eblvm search
    --workers``). Where the platform has a fork server (Linux, macOS), each worker is forked from
    one server process that imported torch and a run's modules once (``eblvm_core.worker_imports``)
    instead of importing them again (about 3 CPU-seconds a worker); elsewhere workers are spawned.
    Either way a worker starts with collection paused (``pause_gc``) until its run builds, and with
    this process's environment as it is when the pool is made; what torch read from the environment
    as it loaded, it read in the server, started with the first pool's environment."""
    return ProcessPoolExecutor(workers, worker_context(), initializer=_start_worker, initargs=(dict(os.environ),))


def worker_context() -> multiprocessing.context.BaseContext:
    """Where worker processes start: the fork server, preloading ``eblvm_core.worker_imports``, where
    the platform has one; else a spawned interpreter."""
    forks = "forkserver" in multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("forkserver" if forks else "spawn")
    if forks:
        context.set_forkserver_preload(["eblvm_core.worker_imports"])
    return context


def _start_worker(environment: dict[str, str]) -> None:
    """A pool worker's first call: the pool's environment, collection paused."""
    os.environ.clear()
    os.environ.update(environment)
    pause_gc()
