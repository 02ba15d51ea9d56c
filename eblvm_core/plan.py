"""The plan of a run: every decision about where and how it computes, made once by ``make_plan``
from the recipe, this machine and how the process was launched, before anything is placed on a
device. Building, the loop and the log read it; nothing decides again. ``eblvm run``, ``eval`` and
``sample`` make it alike.

Two decisions depend on the networks' size, which is known once the data and the networks are
made (on the CPU, as every run makes them first): ``[run] device = "auto"`` trains a small model
on the CPU when its step would not be replayed from a CUDA graph, and ``[run] threads = 0`` gives a
small model one CPU thread. ``Sizes`` carries those counts to the plan.
"""

from __future__ import annotations

import contextlib
import functools
import os
import typing
from collections.abc import Callable, Iterator

import attrs
import torch

from eblvm_core.contracts import Estimator
from eblvm_core.errors import ConfigError
from eblvm_core.recipe import Recipe
from eblvm_core.registry import Entry
from eblvm_core.roles import Precision

# device = "auto" trains on the GPU from this many trainable parameters (all roles together), and
# below it only when the step is replayed from a CUDA graph. Launched kernel by kernel, a small
# model's step is a few hundred tiny launches and one CPU core is faster: on an H100 host
# (docs/benchmarks.md) a 16-parameter checkerboard GRBM steps 2.4x faster on one CPU thread, a
# Frey-face GRBM with 20 hidden units (24,000 parameters with its posterior) 1.1-1.7x, while with
# 400 hidden units (450,000) the GPU is 1.6-2.5x faster; the two cross near 60,000-120,000.
AUTO_GPU_MIN_PARAMETERS = 100_000
SMALL_MODEL = 10_000  # parameters below which one CPU thread is fastest (docs/benchmarks.md)
CAPTURABLE_OPTIMIZERS = ("adam", "sgd")  # the bundled optimizers, fused (so capturable) on a CUDA device
# compile = "auto" compiles runs of at least this many steps, of networks below this many trainable
# parameters: where a compiled step saves more than a cold compile costs (docs/benchmarks.md)
AUTO_COMPILE_STEPS = 5_000
AUTO_COMPILE_MAX_PARAMETERS = 1_000_000


@attrs.frozen
class Machine:
    """What this machine offers: its CUDA devices and whether Apple's MPS is available."""

    cuda_devices: int
    mps: bool

    @classmethod
    def here(cls) -> Machine:
        cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return cls(cuda, bool(torch.backends.mps.is_available()))


@attrs.frozen
class Launch:
    """How this process was launched: its rank among ``world`` processes and its rank on this
    machine (torchrun's, or ``eblvm run --nproc-per-node``'s, environment; one process otherwise)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def here(cls) -> Launch:
        if "WORLD_SIZE" not in os.environ:
            return cls()
        env = os.environ
        return cls(int(env.get("RANK", "0")), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0")))


@attrs.frozen
class Sizes:
    """The networks' parameter counts: all of them, and those that train."""

    parameters: int
    trainable: int

    @classmethod
    def of(cls, networks: dict[str, torch.nn.Module]) -> Sizes:
        params = [p for net in networks.values() for p in net.parameters()]
        return cls(sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad))


@attrs.frozen
class Plan:
    """Every decision of a run, each with its reason where the log gives one.

    ``device`` is where everything is placed (``device_note`` says why ``auto`` chose the CPU
    over a GPU it found, else None); ``precision`` the training steps' autocast and scalers;
    ``threads`` the CPU threads to set (None: torch's default); ``cuda_graph`` why the training
    step is not replayed from a CUDA graph (None: it is); ``compile`` why it is not compiled (None:
    it is), and ``compile_required`` whether ``[run] compile = true`` asks that it be (a step that
    fails to compile is then an error, not the eager step); ``cudnn_benchmark`` whether cuDNN times
    its convolution algorithms; ``rank`` and ``world`` this process among the run's."""

    device: torch.device
    device_note: str | None
    precision: Precision
    threads: int | None
    cuda_graph: str | None
    compile: str | None
    compile_required: bool
    cudnn_benchmark: bool
    rank: int = 0
    world: int = 1

    def lines(self) -> list[str]:
        """What the log says of the plan when training starts on a GPU: cuDNN's autotuning and the
        CUDA graph's verdict (the replay's own line comes from ``graphs``)."""
        if self.device.type != "cuda":
            return []
        lines = (
            ["cuDNN: convolution algorithms chosen by timing ([run] cudnn_benchmark)"] if self.cudnn_benchmark else []
        )
        if self.cuda_graph is not None:
            lines.append(f"CUDA graph: not used: {self.cuda_graph}")
        return lines


def declared_estimator(entry: Entry) -> type[Estimator] | None:
    """The ``Estimator`` subclass an estimator factory says it returns (its return annotation),
    read before anything is built; None when the factory does not say."""
    try:
        returned = typing.get_type_hints(entry.factory).get("return")
    except Exception:  # an annotation that does not resolve: unknown
        return None
    return returned if isinstance(returned, type) and issubclass(returned, Estimator) else None


def not_graph_safe(recipe: Recipe) -> str | None:
    """Why the recipe's estimator does not declare its step graph-safe (None: it does), by its
    class's ``graph_safety`` of the recipe's config."""
    section = recipe.parts["estimator"]
    declared = declared_estimator(section.entry)
    if declared is None:
        return "the estimator's factory does not say which Estimator it returns"
    return declared.graph_safety(section.config)


def graph_verdict(recipe: Recipe, world: int) -> str | None:
    """Why the training step would not be captured in a CUDA graph on a GPU, or None: ``[run]
    cuda_graph``, several processes (their collectives are not captured), fp16 (its GradScaler
    reads its check for inf on the host), the estimator's declaration, and each role's optimizer,
    which must be one known to be capturable (the bundled Adam and SGD are fused on a GPU; a
    scheduled rate is read from a device tensor their fused kernels take). A bf16 step is
    captured with its autocast casts."""
    if not recipe.run.cuda_graph:
        return "[run] cuda_graph = false"
    if world > 1:
        return "several processes train together (their collectives are not captured)"
    if recipe.run.precision == "fp16":
        return "precision fp16 scales the loss with a GradScaler, which reads its check for inf on the host"
    if (unsafe := not_graph_safe(recipe)) is not None:
        return unsafe
    for name, role in recipe.optim.items():
        if role.optimizer.kind not in CAPTURABLE_OPTIMIZERS:
            return f"the optimizer of role '{name}' ({role.optimizer.kind}) is not known to be capturable"
    return None


def compile_verdict(recipe: Recipe, device: torch.device, world: int, sizes: Callable[[], Sizes]) -> str | None:
    """Why the training step is not compiled, or None (``[run] compile``): a compiled step is a
    graph-safe one (the trace records a step that does the same each time), on a CPU (on a GPU the
    step is replayed from a CUDA graph instead), in one process, at fp32, with the bundled
    optimizers (a scheduled rate is an input of the graph). ``"auto"`` also asks that compiling pay: at least
    AUTO_COMPILE_STEPS steps, of networks below AUTO_COMPILE_MAX_PARAMETERS trainable parameters
    (larger steps are matrix products, which compiling does not speed up)."""
    run = recipe.run
    if run.compile is False:
        return "[run] compile = false"
    if device.type != "cpu":
        return f"the run is on {device.type}, where the step is replayed from a CUDA graph instead"
    if world > 1:
        return "several processes train together (their collectives are not traced)"
    if run.precision != "fp32":
        return f"precision {run.precision} is not traced (fp32 only)"
    if (unsafe := not_graph_safe(recipe)) is not None:
        return unsafe
    for name, role in recipe.optim.items():
        if role.optimizer.kind not in CAPTURABLE_OPTIMIZERS:
            return f"the optimizer of role '{name}' ({role.optimizer.kind}) is not known to be traceable"
    if run.compile is True:
        return None
    if run.steps < AUTO_COMPILE_STEPS:
        return f"{run.steps:,} steps are too few to repay compiling (auto compiles from {AUTO_COMPILE_STEPS:,})"
    trainable = sizes().trainable
    if trainable >= AUTO_COMPILE_MAX_PARAMETERS:
        return (
            f"{trainable:,} trainable parameters: the step is mostly matrix products, which compiling does not "
            f"speed up (auto compiles below {AUTO_COMPILE_MAX_PARAMETERS:,})"
        )
    return None


def _device(choice: str, machine: Machine, launch: Launch) -> torch.device:
    """The device ``[run] device`` names on this machine (a rank of several takes the GPU of its
    local rank); a ConfigError when it is not available here."""
    if choice == "auto":
        choice = "cuda" if machine.cuda_devices else "cpu"
    if choice.startswith("cuda"):
        if not machine.cuda_devices:
            raise ConfigError("run", "device", f"{choice} requested but no CUDA device is available")
        index = int(choice.partition(":")[2] or 0)
        if index >= machine.cuda_devices:
            raise ConfigError(
                "run", "device", f"{choice} requested but this machine has {machine.cuda_devices} CUDA device(s)"
            )
        return torch.device("cuda", launch.local_rank) if launch.world > 1 else torch.device(choice)
    if choice == "mps" and not machine.mps:
        raise ConfigError("run", "device", "mps requested but it is not available")
    if launch.world > 1 and choice not in ("cpu", "cuda"):
        raise ConfigError("run", "device", f"several processes need cpu or cuda, not {choice}")
    return torch.device(choice)


def make_plan(
    recipe: Recipe, sizes: Callable[[], Sizes], machine: Machine | None = None, launch: Launch = Launch()
) -> Plan:
    """The plan of ``recipe`` on ``machine`` (default: this one) for a process launched as
    ``launch``; ``sizes`` counts the networks' parameters, asked only where a decision needs them.
    A ConfigError names [run] device when the device is not available."""
    machine = Machine.here() if machine is None else machine
    sizes = functools.cache(sizes)  # counted once, however many decisions ask
    run = recipe.run
    try:
        device = _device(run.device, machine, launch)
    except ConfigError as exc:
        recipe.blame(exc)
        raise
    verdict = graph_verdict(recipe, launch.world)
    note = None
    if run.device == "auto" and device.type == "cuda" and launch.world == 1 and verdict is not None:
        count = sizes().trainable
        if count < AUTO_GPU_MIN_PARAMETERS:
            note = f"{count:,} trainable parameters, too few for the GPU to pay without a CUDA graph ({verdict})"
            device = torch.device("cpu")
    threads: int | None = run.threads or None
    if threads is None and device.type == "cpu" and sizes().parameters < SMALL_MODEL:
        threads = 1  # a tiny model's steps are many tiny operations, which a second thread only slows
    compiled = compile_verdict(recipe, device, launch.world, sizes)
    if run.compile is True and compiled is not None:
        error = ConfigError("run", "compile", f"true, but the step cannot be compiled: {compiled}")
        recipe.blame(error)
        raise error
    return Plan(
        device=device,
        device_note=note,
        precision=Precision(run.precision, device.type),
        threads=threads,
        cuda_graph=verdict if device.type == "cuda" else f"the run is on {device.type}, not a CUDA device",
        compile=compiled,
        compile_required=run.compile is True,
        cudnn_benchmark=run.cudnn_benchmark and device.type == "cuda",
        rank=launch.rank,
        world=launch.world,
    )


def use_threads(plan: Plan) -> int:
    """Set the plan's CPU threads (they stay); returns the number in use."""
    if plan.threads:
        torch.set_num_threads(plan.threads)
    return torch.get_num_threads()


@contextlib.contextmanager
def numerics(plan: Plan) -> Iterator[int]:
    """The plan's CPU threads set (they stay), and within the block subnormal floats flushed to
    zero on a CPU and cuDNN's autotuning as planned (torch's settings put back after); yields the
    number of CPU threads in use.

    Subnormals (|x| < 1.2e-38 in float32): a relaxed Bernoulli sample at T = 0.1 and the unrolled
    gradients through it are full of them, and x86 CPUs compute with them many times slower
    (BiDSM on Frey face: 284 ms a step late in training, 71 ms flushed; docs/benchmarks.md). Only
    numbers below the smallest normal one change: 2,000 steps of the main job end with the same bits."""
    threads = use_threads(plan)
    flushed = plan.device.type == "cpu" and torch.set_flush_denormal(True)
    cudnn = torch.backends.cudnn.benchmark
    if plan.cudnn_benchmark:
        torch.backends.cudnn.benchmark = True
    try:
        yield threads
    finally:
        torch.backends.cudnn.benchmark = cudnn
        if flushed:
            torch.set_flush_denormal(False)
