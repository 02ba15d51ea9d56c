"""A traced training step (an aten graph over the run's state, the batch and the step's random
numbers, which changes the state in place) cut into parts and compiled by TorchInductor, each part
once: the repeats of a step marked ``REPEATED`` (``fit_posterior``'s K real lower-level steps) share
one compiled part, called once a repeat, so the compile sees each repeat's operations once.

A part is compiled from its own functional graph (``make_fx`` of ``functionalize``, decomposed by
inductor's table) by ``torch._inductor.compile_to_python``, without dynamo or AOTAutograd: the call
is inductor's own ``call(args)``, no guards or runtime wrappers. Its intermediate buffers are
allocated once, with the compiled module, instead of on every call (``preallocated``), and it
imports only the inductor helpers it calls (``unused_imports_dropped``). Where a step
has several parts and the machine a second core, the smaller parts are compiled in a process of
their own (``compile_apart``, run as ``python -m eblvm_core.inductor``) while this one compiles the
largest, and found in the cache afterwards. Compiled sources are kept in inductor's cache folder,
so a second run of the same step loads them instead of tracing and compiling its parts again.
"""

from __future__ import annotations

import hashlib
import operator
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import Tensor
from torch.fx import Graph, GraphModule, Node

from eblvm_core import kernel_library
from eblvm_core.bilevel import REPEATED

# A run of identical repeats is compiled once and called each time when the repeats after the first
# hold at least this many graph nodes: below it the second compile (its C++ header above all) costs
# more than the nodes it saves (docs/benchmarks.md).
REPEATS_WORTH_CUTTING = 200
# Inductor settings that change how a part's kernels are built, not what they compute: left out of
# its key, so a part compiled before the machine had the precompiled header is read after it has.
BUILD_ONLY = {"cpp_cache_precompile_headers"}

RANGE_START = torch.ops.profiler._record_function_enter_new.default


def is_profiler_node(node: Node) -> bool:
    """A profiler range's start or end (``record_function``): it computes nothing."""
    return node.op == "call_function" and str(node.target).startswith("profiler.")


def _starts_repeat(node: Any) -> bool:
    return isinstance(node, Node) and node.target is RANGE_START and node.args[:1] == (REPEATED,)


class _Position(int):
    """A node named by its position: ``%3``, which no literal argument's repr reads as."""

    def __repr__(self) -> str:
        return f"%{int(self)}"


def positional(graph: Graph, root: torch.nn.Module | None = None) -> list[tuple[str, ...]]:
    """``graph``'s nodes in order as (operation, target, arguments), each node named by its position,
    not its name (a GraphModule unpickled in another process has the same operations under other
    names); an attribute that ``root`` holds as the hash of its bytes."""
    position: dict[Node, _Position] = {}
    rows: list[tuple[str, ...]] = []
    for i, node in enumerate(graph.nodes):
        position[node] = _Position(i)
        target = node.target
        if node.op == "placeholder":
            rows.append(("placeholder",))
        elif node.op == "get_attr":
            value = operator.attrgetter(str(target))(root) if root is not None else target
            held = (
                hashlib.sha256(value.detach().cpu().numpy().tobytes()).hexdigest()
                if isinstance(value, Tensor)
                else value
            )
            rows.append(("get_attr", repr(held)))
        else:
            if isinstance(target, (str, torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
                name = str(target)
            else:
                name = f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}"
            arguments = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: position[n])
            rows.append((node.op, name, repr(arguments)))
    return rows


def segments(graph: Graph) -> list[tuple[bool, list[Node]]]:
    """The graph's computing nodes in order (its inputs, constants, output and profiler ranges left out),
    cut where an outermost ``REPEATED`` range starts and ends: a list of (in such a range, nodes)."""
    cut: list[tuple[bool, list[Node]]] = [(False, [])]
    depth = 0
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        if is_profiler_node(node):
            if _starts_repeat(node):
                depth += 1
                if depth == 1:
                    cut.append((True, []))
            elif node.args and _starts_repeat(node.args[0]):
                depth -= 1
                if depth == 0:
                    cut.append((False, []))
            continue
        cut[-1][1].append(node)
    return [(repeated, nodes) for repeated, nodes in cut if nodes]


def _written(node: Node) -> list[Node]:
    """The arguments ``node`` changes in place (an in-place or out= operator's written tensors)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.is_mutable:
        return []
    written = []
    for i, argument in enumerate(schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
            written += [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, Node)]
    return written


def read_through_in_place_results(graph: Graph) -> None:
    """Let every reader of an in-place operation's result (``p.sub_(...)`` returns ``p``) read the
    tensor it changed instead: the same tensor, so the step computes the same, but a part that
    reads the state then reads it as an input of the step, which it may change in place, not as a
    value another part returned."""
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or len(schema.returns) != 1:
            continue
        returned = schema.returns[0].alias_info
        if returned is None or not returned.is_write:
            continue
        for i, argument in enumerate(schema.arguments):
            if argument.alias_info is not None and argument.alias_info.before_set == returned.before_set:
                changed = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
                if isinstance(changed, Node):
                    node.replace_all_uses_with(changed)
                break


def recomputable(graph: Graph) -> set[Node]:
    """The nodes any later part may compute again instead of reading them: views of an input, a
    constant or a recomputable node (a view sees its base's changes wherever it is taken);
    and pointwise operations on values no operation of the step changes in place, such as the
    batch and the random draws (noise added to the batch)."""
    changed: set[Node] = set()
    for node in graph.nodes:
        todo = _written(node)
        while todo:  # a tensor changed through a view changes its base too
            value = todo.pop()
            if value not in changed:
                changed.add(value)
                base = value.args[0] if value.args else None
                if value.op == "call_function" and getattr(value.target, "is_view", False) and isinstance(base, Node):
                    todo.append(base)
    leaves = {n for n in graph.nodes if n.op in ("placeholder", "get_attr")}  # a part reads them as inputs
    found: set[Node] = set()
    stable = {n for n in leaves if n not in changed}  # values that stay what they are through the step
    for node in graph.nodes:
        if node.op != "call_function" or _written(node) or is_profiler_node(node):
            continue
        inputs = node.all_input_nodes
        if getattr(node.target, "is_view", False) and inputs and all(a in found or a in leaves for a in inputs):
            found.add(node)
        elif torch.Tag.pointwise in getattr(node.target, "tags", ()) and all(a in stable for a in inputs):
            found.add(node)
        else:
            continue
        if node not in changed and all(a in stable for a in inputs):
            stable.add(node)
    return found


@attrs.define
class Part:
    """Consecutive nodes of the traced graph computed together: ``graph`` (its own placeholders
    stand for ``inputs``, the values it reads from the step's inputs and earlier parts; the
    recomputable ones it reads are computed in it again), ``outputs`` (its nodes that later parts
    or the step's result read), ``repeated`` (one of a run of identical repeats)."""

    nodes: list[Node]
    repeated: bool
    graph: Graph = attrs.field(init=False)
    inputs: list[Node] = attrs.field(init=False)
    copies: dict[Node, Node] = attrs.field(init=False)
    outputs: list[Node] = attrs.Factory(list)

    def extract(self, again: set[Node]) -> None:
        """Build ``graph``, ``inputs`` and ``copies`` (traced node -> its node in ``graph``)."""
        members, seen = set(self.nodes), set()
        inputs: list[Node] = []
        recomputed: list[Node] = []

        def visit(node: Node) -> None:
            if node in members or node in seen:
                return
            seen.add(node)
            if node in again:
                for value in node.all_input_nodes:
                    visit(value)
                recomputed.append(node)
            else:
                inputs.append(node)

        for node in self.nodes:
            for value in node.all_input_nodes:
                visit(value)
        graph, copies = Graph(), {}
        for i, node in enumerate(inputs):
            copies[node] = graph.placeholder(f"input_{i}")
            copies[node].meta = dict(node.meta)
        for node in [*recomputed, *self.nodes]:
            copies[node] = graph.node_copy(node, copies.__getitem__)
        self.graph, self.inputs, self.copies = graph, inputs, copies

    def signature(self) -> tuple:
        """What two parts share when one compiled module computes both: every node's operation and
        arguments (``positional``) and the inputs' shapes, strides and dtypes."""
        inputs = tuple(
            (tuple(value.shape), value.stride(), value.dtype) if isinstance(value, Tensor) else None
            for value in (node.meta.get("val") for node in self.graph.nodes if node.op == "placeholder")
        )
        return inputs, tuple(positional(self.graph))

    def module(self, root: torch.nn.Module, positions: Sequence[int]) -> GraphModule:
        """``graph`` as a module (attributes from ``root``) that returns its copies of the nodes at
        ``positions`` of ``nodes``."""
        graph, copies = Graph(), dict[Node, Node]()
        graph.graph_copy(self.graph, copies)
        graph.output(tuple(copies[self.copies[self.nodes[i]]] for i in positions))
        return GraphModule(root, graph)

    def changes_state(self) -> bool:
        return any(_written(node) for node in self.nodes)


def cut(graph: Graph, pieces: list[tuple[bool, list[Node]]], results: Iterable[Node]) -> list[Part]:
    """The parts the step's ``pieces`` (``segments``) are computed in: each run of identical
    repeats worth cutting (``REPEATS_WORTH_CUTTING``) a part a repeat, the nodes between them one
    part; ``results`` are the nodes the step returns. A part whose outputs all are recomputed where
    they are read, and that changes nothing, is left out."""
    again = recomputable(graph)

    def parts_of(kept: set[int]) -> list[Part]:
        parts: list[Part] = []
        for i, (_, nodes) in enumerate(pieces):
            if i in kept:
                parts.append(Part(nodes, True))
            elif parts and not parts[-1].repeated:
                parts[-1].nodes.extend(nodes)
            else:
                parts.append(Part(list(nodes), False))
        for part in parts:
            part.extract(again)
        return parts

    repeats = [i for i, (repeated, _) in enumerate(pieces) if repeated]
    trial = parts_of(set(repeats))
    by_signature: dict[tuple, list[int]] = {}
    for i, part in zip(repeats, (p for p in trial if p.repeated)):
        by_signature.setdefault(part.signature(), []).append(i)
    kept = {
        i
        for group in by_signature.values()
        if len(group) > 1 and (len(group) - 1) * len(pieces[group[0]][1]) >= REPEATS_WORTH_CUTTING
        for i in group
    }
    parts = parts_of(kept)
    read = {node for part in parts for node in part.inputs} | set(results)
    for part in parts:
        part.outputs = [node for node in part.nodes if node in read]
    return [part for part in parts if part.outputs or part.changes_state()]


_sources_read = 0  # parts whose compiled source this process read from the cache folder


def compile_part(module: GraphModule, example: Sequence[Tensor], options: dict[str, Any]) -> Callable:
    """``call(inputs: list) -> outputs`` of ``module`` (a part: it changes its inputs in place as the
    part does) compiled by inductor with config ``options``, from its functional form traced on
    ``example``; to be called under ``torch.no_grad()``. The module's source is kept in inductor's
    cache folder under a key of everything it is made from (``source_key``), so a second compile of
    the same part only loads it (its kernels then come from inductor's own cache)."""
    global _sources_read
    with torch._inductor.config.patch(options):  # loading the module builds its kernels with the same flags
        path = _source_path(module, example, options)
        if path.is_file():
            try:
                call = torch._inductor.load_from_python(path.read_text())
                _sources_read += 1
                return call
            except Exception:  # a file cut short, a kernel that no longer builds: compiled again below
                pass
        source = kernel_library.one_library(preallocated(unused_imports_dropped(_compiled_source(module, example))))
        call = torch._inductor.load_from_python(source)
        _write_atomically(path, source)
        return call


def is_cached(module: GraphModule, example: Sequence[Tensor], options: dict[str, Any]) -> bool:
    """Whether ``compile_part`` would find the part's source in the cache folder."""
    return _source_path(module, example, options).is_file()


def _source_path(module: GraphModule, example: Sequence[Tensor], options: dict[str, Any]) -> Path:
    """Where the part's compiled source is kept: the cache folder, under its ``source_key``."""
    return _cache_folder() / f"{source_key(module, example, options)}.py"


def _compiled_source(module: GraphModule, example: Sequence[Tensor]) -> str:
    """Inductor's module source of ``module``'s functional form traced on ``example`` (under the
    caller's inductor config)."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    functional = make_fx(
        torch.func.functionalize(module, remove="mutations"),
        decomposition_table=select_decomp_table(),
        tracing_mode="fake",
        _allow_non_fake_inputs=True,  # the example is real tensors: the step's state
    )(*example)
    with kernel_library.kernels_unbuilt():  # built when the source is loaded, one library for all
        source, _ = torch._inductor.compile_to_python(functional, list(example))
    return source


def source_key(module: GraphModule, example: Sequence[Tensor], options: dict[str, Any]) -> str:
    """A hash of what a part's compiled source is made from: the part's graph (every operation and
    constant, nodes by position: ``positional``), each input's shape, strides, offset, dtype and
    device, the threads (inductor writes parallel loops for them), inductor's config with
    ``options`` applied (but for ``BUILD_ONLY``), the CPU's vector instructions as torch reads them
    (inductor's own check compiles a program, and changes the flags of the kernels compiled after
    it), torch's version and the sources of this module and of ``kernel_library`` (both rewrite
    what inductor wrote)."""
    with torch._inductor.config.patch(options):
        config = sorted((k, v) for k, v in torch._inductor.config.save_config_portable().items() if k not in BUILD_ONLY)
    digest = hashlib.sha256()
    for item in (
        positional(module.graph, module),
        *(
            (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device) if isinstance(t, Tensor) else t
            for t in example
        ),
        torch.get_num_threads(),
        config,
        torch.backends.cpu.get_cpu_capability(),  # what inductor picks its vector instructions from
        torch.__version__,
        Path(__file__).read_bytes(),
        Path(kernel_library.__file__).read_bytes(),
    ):
        digest.update(repr(item).encode() if not isinstance(item, bytes) else item)
    return digest.hexdigest()[:32]


def header_precompiled() -> bool:
    """Whether this machine holds a C++ header inductor precompiled (``*.gch`` in its folder for
    them, which is outside the cache folder and kept across runs). One built for other compiler
    flags (another torch, vector instructions) is not used: inductor builds the one it needs."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return any(Path(default_cache_dir(), "precompiled_headers").glob("*.gch"))


def _cache_folder() -> Path:
    """Where compiled sources are kept: ``eblvm`` in inductor's cache folder (TORCHINDUCTOR_CACHE_DIR)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "eblvm"


def _write_atomically(path: Path, text: str) -> None:
    """``text`` into ``path`` through a temporary file and a rename: a reader never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(handle, "w") as file:
        file.write(text)
    os.replace(temporary, path)


class Apart:
    """Parts compiled by another process (``python -m eblvm_core.inductor FILE``) into inductor's
    cache, while this one works; ``wait()`` before compiling them here, where they are then read
    from the cache."""

    def __init__(self, jobs: list[tuple[GraphModule, list[Tensor], dict[str, Any]]]):
        self.folder = tempfile.mkdtemp(prefix="eblvm-compile-")
        payload = os.path.join(self.folder, "parts.pt")
        # this process's threads and inductor config, so the other compiles what this one would; it keeps
        # each part under the key of the module it compiled, which this one finds only where unpickling
        # gave back the same graph (it may not: unpickling traces a GraphModule's code again, which can
        # fold constants)
        config = torch._inductor.config.save_config()
        torch.save({"jobs": jobs, "threads": torch.get_num_threads(), "config": config}, payload)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "eblvm_core.inductor", payload],
            cwd=Path(__file__).resolve().parents[1],  # this eblvm_core, not one in the folder the run started in
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def wait(self, timeout: float) -> None:
        """Until the other process ends, or stop it after ``timeout`` seconds (this one then compiles
        what it did not)."""
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


IDLE_CORES_FOR_APART = 0.75  # cores that stood idle while the step was traced, at least


def compile_apart(jobs: list[tuple[GraphModule, list[Tensor], dict[str, Any]]], idle: float) -> Apart | None:
    """``compile_part`` of each (module, example, options) of ``jobs`` started in another process,
    or None where there is nothing to start or no idle core to run it on: ``idle`` (``idle_cores``)
    under IDLE_CORES_FOR_APART, as when tests run on every core."""
    if not jobs or idle < IDLE_CORES_FOR_APART:
        return None
    return Apart(jobs)


def core_clock() -> tuple[float, float | None]:
    """(now, the seconds all the machine's cores have stood idle since boot): the start of a stretch
    ``idle_cores`` reads. The idle seconds come from /proc/stat (Linux), None elsewhere."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()  # cpu user nice system idle iowait ... (clock ticks)
        idle = (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        idle = None
    return time.monotonic(), idle


def idle_cores(since: tuple[float, float | None]) -> float:
    """How many of the machine's cores stood idle on average since ``since`` (``core_clock()``), or,
    without /proc/stat, how many the last minute's load average leaves free."""
    start, idle_start = since
    now, idle_now = core_clock()
    if idle_start is None or idle_now is None or now <= start:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float(os.cpu_count() or 1)  # none: no core idle
        return (os.cpu_count() or 1) - load
    return (idle_now - idle_start) / (now - start)


def cache_hits() -> int:
    """How many parts this process has read compiled so far: their source from the cache folder, or
    inductor's compile of their graph from its own cache."""
    from torch._dynamo.utils import counters

    return _sources_read + counters["inductor"]["fxgraph_cache_hit"]


def _compile_jobs(payload: str) -> None:
    """The other process of ``compile_apart``: compile each part of the file ``payload`` (written by
    this module a moment ago, in a folder of its own) with the threads and the inductor config the
    parent runs with, which decide what inductor writes and the keys it is kept under."""
    saved = torch.load(payload, weights_only=False)  # a GraphModule: this program's own file, not a user's
    torch.set_num_threads(saved["threads"])
    torch._inductor.config.load_config(saved["config"])
    with torch.no_grad():
        for module, example, options in saved["jobs"]:
            compile_part(module, example, options)


_INDUCTOR_IMPORT = re.compile(r"^from torch\._inductor\.[\w.]+ import (\w+)(?: as (\w+))?\n", re.M)


def unused_imports_dropped(source: str) -> str:
    """Inductor's module ``source`` without the lines importing a name from ``torch._inductor`` that
    the module never uses: loading a kept part then skips importing what it does not call (its
    library-call and memory-planning helpers, a second of a warm run's load)."""

    def kept(line: re.Match) -> str:
        name = line.group(2) or line.group(1)
        return line.group(0) if len(re.findall(rf"\b{name}\b", source)) > 1 else ""

    return _INDUCTOR_IMPORT.sub(kept, source)


_ALLOCATION = re.compile(r"^(\s+)(buf\d+) = (empty_strided_cpu\(.*\))$")


def preallocated(source: str) -> str:
    """Inductor's module ``source`` with each intermediate buffer of ``call`` allocated once, when
    the module loads, instead of on every call: a small step's few hundred allocations cost more
    than its arithmetic. Buffers that ``call`` returns, or that reach its result through a reuse or
    a view, stay allocated per call, so results never share memory across calls. Calls must not
    overlap (a training step's do not). Source of another shape is returned as it is."""
    head, sep, body = source.partition("    def call(self, args):\n")
    if not sep or "class Runner" not in head:
        return source
    lines = body.split("\n")
    end = next((i for i, line in enumerate(lines) if line.startswith("        return ")), None)
    if end is None:
        return source
    escaping = set(re.findall(r"\bbuf\d+\b", lines[end]))
    sources: dict[str, set[str]] = {}
    for line in lines[:end]:
        if (match := re.match(r"\s+(buf\d+) = (.*)$", line)) is not None:
            sources.setdefault(match.group(1), set()).update(re.findall(r"\bbuf\d+\b", match.group(2)))
    todo = list(escaping)
    while todo:
        for name in sources.get(todo.pop(), ()):
            if name not in escaping:
                escaping.add(name)
                todo.append(name)
    allocated = [m.group(2) for line in lines[:end] if (m := _ALLOCATION.match(line))]
    if len(allocated) != len(set(allocated)):
        return source  # a name allocated twice: leave the module as it is
    once = set(allocated) - escaping
    kept, rewritten = [], []
    for line in lines[:end]:
        match = _ALLOCATION.match(line)
        if match is not None and match.group(2) in once:
            kept.append(f"_kept_{match.group(2)} = {match.group(3)}")
            line = f"{match.group(1)}{match.group(2)} = _kept_{match.group(2)}"
        rewritten.append(line)
    runner = head.rindex("class Runner")
    return head[:runner] + "\n".join(kept) + "\n\n\n" + head[runner:] + sep + "\n".join(rewritten + lines[end:])


if __name__ == "__main__":
    _compile_jobs(sys.argv[1])
