"""Imported once by the fork server of a pool of run workers (``startup.worker_pool``): torch,
``torch._dynamo`` and the modules a run loads, with collection paused and their objects frozen after
(as ``eblvm run`` loads them), so that every worker forked from the server starts with them."""

from eblvm_core import startup

startup.pause_gc()
import eblvm_core.session  # noqa: E402, F401 - loads torch, the checkpoint and the trainer

startup.resume_gc()  # imports torch._dynamo, freezes what exists, collects again
