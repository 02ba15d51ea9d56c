"""Cutting a traced step into parts (``eblvm_core.inductor``): where the cuts fall, what a part reads
and returns, what it may compute again, and preallocated buffers that never alias a result; a cut,
compiled step takes the step the eager code takes."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from eblvm_core import compiled as compiled_module
from eblvm_core import inductor
from eblvm_core.bilevel import REPEATED
from eblvm_core.compiled import CompiledStep, _lift_draws

K = 4


def make_step(w: torch.Tensor, v: torch.Tensor, repeats: int = K):
    """A step with ``repeats`` identical in-place updates of w (each in a REPEATED range) between a
    prologue that adds noise to the batch and a final update of v; returns its metrics."""

    def step(batch: torch.Tensor) -> dict[str, torch.Tensor]:
        x = batch + 0.1 * torch.randn_like(batch)
        loss = None
        for _ in range(repeats):
            with torch.profiler.record_function(REPEATED):
                loss = ((x @ w).tanh() ** 2).mean()
                w.sub_(0.05 * (w - loss))
        final = (x @ w * v).sum()
        v.mul_(0.9).add_(final.sin())
        return {"loss": loss, "final": final}

    return step


def traced(repeats: int = K):
    torch.manual_seed(0)
    w, v, batch = torch.randn(3, 5), torch.randn(5), torch.randn(8, 3)
    module = make_fx(lambda b, *state: make_step(w, v, repeats)(b), tracing_mode="real")(batch, w, v)
    _lift_draws(module.graph)  # the noise becomes an input, as CompiledStep makes it
    inductor.read_through_in_place_results(module.graph)
    return module


def results(module):
    output = next(n for n in module.graph.nodes if n.op == "output")
    return [n for n in torch.utils._pytree.tree_leaves(output.args[0]) if isinstance(n, torch.fx.Node)]


def test_segments_fall_where_the_repeated_ranges_start_and_end():
    module = traced()
    pieces = inductor.segments(module.graph)
    assert [repeated for repeated, _ in pieces] == [False, *[True] * K, False]
    sizes = {len(nodes) for repeated, nodes in pieces if repeated}
    assert len(sizes) == 1, "the repeats hold the same operations"
    assert not any(inductor.is_profiler_node(n) for _, nodes in pieces for n in nodes)


def test_identical_repeats_share_a_signature_and_each_part_returns_what_later_parts_read(monkeypatch):
    monkeypatch.setattr(inductor, "REPEATS_WORTH_CUTTING", 1)
    module = traced()
    parts = inductor.cut(module.graph, inductor.segments(module.graph), results(module))
    # the prologue (noise added to the batch: pointwise on inputs no step changes) is computed again
    # where it is read, so it is no part of its own
    assert [p.repeated for p in parts] == [True] * K + [False]
    assert len({p.signature() for p in parts[:K]}) == 1
    assert parts[0].signature() != parts[-1].signature()
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    for part in parts[:K]:
        # each repeat reads the state itself (w, changed in place), never a value another part returned
        assert set(part.inputs) <= set(placeholders), part.inputs
    read_later = {n for p in parts for n in p.inputs} | set(results(module))
    for part in parts:
        assert set(part.outputs) == {n for n in part.nodes if n in read_later}
    assert parts[-2].outputs and not parts[0].outputs, "only the last repeat's loss is read (a metric)"


def test_a_small_run_of_repeats_is_not_cut():
    module = traced(repeats=2)
    parts = inductor.cut(module.graph, inductor.segments(module.graph), results(module))
    assert len(parts) == 1 and not parts[0].repeated


def test_what_may_be_computed_again():
    torch.manual_seed(0)
    w, batch = torch.randn(3), torch.randn(3)

    def step(b, *state):
        noisy = b * 2 + 1  # pointwise on the batch: recomputable
        seen = w.t()  # a view of the state: recomputable (it sees w's changes wherever it is taken)
        doubled = w * 2  # pointwise on w, which the step changes: not
        w.add_(noisy)
        total = (seen * doubled).sum()  # a reduction: not
        return {"total": total}

    graph = make_fx(step, tracing_mode="real")(batch, w).graph
    b, w_input = [n for n in graph.nodes if n.op == "placeholder"]
    aten = torch.ops.aten
    again = inductor.recomputable(graph)
    by_input = {(n.target, n.args[0]): n for n in graph.nodes if n.op == "call_function"}
    assert by_input[aten.mul.Tensor, b] in again and by_input[aten.t.default, w_input] in again
    assert by_input[aten.mul.Tensor, w_input] not in again
    assert not any(n.target is aten.sum.default for n in again)


SOURCE = """import torch
def empty_strided_cpu(size, stride, dtype):
    return torch.empty_strided(size, stride, dtype=dtype)


class Runner:
    def __init__(self, partitions):
        self.partitions = partitions

    def call(self, args):
        arg0_1, = args
        args.clear()
        buf0 = empty_strided_cpu((3, ), (1, ), torch.float32)
        buf1 = empty_strided_cpu((3, ), (1, ), torch.float32)
        buf2 = empty_strided_cpu((3, ), (1, ), torch.float32)
        buf0.copy_(arg0_1 * 2)
        buf1.copy_(buf0 + 1)
        buf3 = buf1; del buf1  # reuse
        buf2.copy_(buf3 * 3)
        buf4 = buf2.view(3)
        return (buf3, buf4, )


runner = Runner(partitions=[])
call = runner.call
"""


def run_source(source: str) -> dict:
    namespace: dict = {}
    exec(compile(source, "<test>", "exec"), namespace)
    return namespace


def test_preallocation_keeps_only_the_buffers_no_result_reaches():
    source = inductor.preallocated(SOURCE)
    assert "_kept_buf0 = empty_strided_cpu" in source
    # buf1 becomes a result through a reuse, buf2 through a view: both stay per call
    assert "_kept_buf1" not in source and "_kept_buf2" not in source
    original, kept = run_source(SOURCE), run_source(source)
    x = torch.tensor([1.0, 2.0, 3.0])
    first = kept["call"]([x])
    held = [t.clone() for t in first]
    second = kept["call"]([x * 10])
    for a, b in zip(first, held):
        assert torch.equal(a, b), "a later call changed an earlier call's result"
    for a, b in zip(second, original["call"]([x * 10])):
        assert torch.equal(a, b)
    assert kept["_kept_buf0"] is not None


def test_preallocation_leaves_source_of_another_shape_alone():
    assert inductor.preallocated("def call(args):\n    return ()\n") == "def call(args):\n    return ()\n"


def test_an_import_from_inductor_the_module_never_uses_is_dropped():
    """Names imported from torch._inductor and used nowhere else go (loading them costs a second);
    used ones and other imports stay."""
    header = [
        "import torch\n",
        "from math import inf\n",
        "from torch._inductor.codegen.memory_planning import _align as align\n",
        "from torch._inductor.select_algorithm import extern_kernels\n",
        "from torch._inductor.hooks import run_intermediate_hooks\n",
        "from torch._inductor.async_compile import AsyncCompile\n",
    ]
    body = "async_compile = AsyncCompile()\n\ndef call(args):\n    return (align(13), args[0] + 1)\n"
    source = "".join(header) + body
    dropped = inductor.unused_imports_dropped(source)
    assert dropped == "".join(header[:3] + header[5:]) + body
    assert run_source(dropped)["call"]([torch.tensor(1.0)])[1] == 2.0
    used = source.replace("args[0] + 1", "extern_kernels.mm(args[0], args[0])")
    assert "import extern_kernels\n" in inductor.unused_imports_dropped(used)


@pytest.mark.slow
def test_a_kept_part_without_library_calls_loads_without_inductors_library_call_helpers(monkeypatch, tmp_path):
    """A part of fused loops alone: its kept source imports neither inductor's library-call
    (select_algorithm) nor memory-planning module, and computes what the part does."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

    def part(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
        w.mul_(0.5).add_(x.tanh().mean(0))
        return ((x * w).sum(),)

    x, w = torch.randn(4, 3), torch.randn(3)
    module = make_fx(part)(x, w.clone())
    changed = w.clone()
    with torch.no_grad():
        (total,) = inductor.compile_part(module, [x, changed], {"pattern_matcher": False})([x, changed])
    (source,) = [p.read_text() for p in (tmp_path / "eblvm").glob("*.py")]
    assert "torch._inductor.select_algorithm import" not in source.split('"""')[-1]
    assert "torch._inductor.codegen.memory_planning import" not in source.split('"""')[-1]
    expected_w = w.clone()
    (expected,) = part(x, expected_w)
    torch.testing.assert_close(total, expected)
    torch.testing.assert_close(changed, expected_w)


@pytest.mark.slow
@pytest.mark.parametrize("apart", [False, True], ids=["one process", "the repeat compiled by another"])
def test_a_cut_compiled_step_takes_the_eager_step(monkeypatch, tmp_path, apart):
    """Compiled with its repeats cut into one part called K times, three steps take the eager steps
    (to float rounding) and consume the random stream as they do; the metrics of a step stay what
    they were after later steps (no preallocated buffer reaches a result). With a core free, the
    other process compiles the repeat into the cache, where this one finds it."""
    monkeypatch.setattr(inductor, "REPEATS_WORTH_CUTTING", 1)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # the other process compiles into it
    monkeypatch.setattr(inductor, "idle_cores", lambda since: 2.0 if apart else 0.0)
    monkeypatch.setattr(compiled_module, "APART_GRACE_S", 600.0)  # a loaded test machine: wait for it
    started: list[inductor.Apart] = []
    start_apart = inductor.compile_apart
    monkeypatch.setattr(
        inductor, "compile_apart", lambda jobs, idle: started.append(a) or a if (a := start_apart(jobs, idle)) else None
    )
    torch.manual_seed(0)
    w, v = torch.randn(3, 5), torch.randn(5)
    batches = [torch.randn(8, 3) for _ in range(3)]
    read_before = inductor.cache_hits()
    compiled = CompiledStep(make_step(w, v), [w, v], batches[0])
    assert (compiled.calls, compiled.compiled_parts) == (K + 1, 2)
    assert [a.process.returncode for a in started] == ([0] if apart else [])
    assert inductor.cache_hits() - read_before == (1 if apart else 0), "the repeat read from the cache"
    assert not compiled.from_cache
    start, rng = [w.clone(), v.clone()], torch.get_rng_state()
    eager = [{k: t.clone() for k, t in make_step(w, v)(b).items()} for b in batches]
    after, eager_rng = [w.clone(), v.clone()], torch.get_rng_state()
    w.copy_(start[0]), v.copy_(start[1]), torch.set_rng_state(rng)
    got = [compiled(b) for b in batches]
    assert torch.equal(torch.get_rng_state(), eager_rng)
    torch.testing.assert_close([w, v], after, rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(got, eager):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    assert CompiledStep(make_step(w, v), [w, v], batches[0]).from_cache, "the same step again: both parts read"


@pytest.mark.slow
def test_a_compiled_step_checks_the_batch_once_and_its_parts_check_no_sizes(monkeypatch, tmp_path):
    """A compiled part checks none of its inputs' sizes (a tenth of a small step's time); the step
    checks the batch once, before any part runs: a batch of another shape, strides or dtype than the
    traced one is a one-line ValueError, and the state and the random stream stay as they were. A
    batch like the traced one steps as the eager step does."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    w, v, batch = torch.randn(3, 5), torch.randn(5), torch.randn(8, 3)
    compiled = CompiledStep(make_step(w, v), [w, v], batch)
    sources = [p.read_text() for p in (tmp_path / "eblvm").glob("*.py")]
    assert sources and not any("assert_size_stride(" in s for s in sources), "a part checks its inputs' sizes"
    before = [w.clone(), v.clone()]
    for other in (torch.randn(4, 3), torch.randn(3, 8).t(), batch.double()):
        rng = torch.get_rng_state()
        with pytest.raises(ValueError, match=r"^the compiled step was traced on batches of shape \(8, 3\)") as info:
            compiled(other)
        assert "\n" not in str(info.value)
        assert torch.equal(w, before[0]) and torch.equal(v, before[1]), "a part ran on the refused batch"
        assert torch.equal(torch.get_rng_state(), rng), "the refused step drew its random numbers"
    rng = torch.get_rng_state()
    eager = make_step(w.clone(), v.clone())(batch)
    torch.set_rng_state(rng)
    torch.testing.assert_close(compiled(batch.clone()), eager, rtol=1e-5, atol=1e-6)


def tiny_part() -> torch.fx.GraphModule:
    """A part as ``Part.module`` makes one: w ← w − 0.1·tanh(x @ w) in place; returns (x @ w).sum()."""

    def part(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
        y = x @ w
        w.sub_(0.1 * y.tanh().mean(0))
        return (y.sum(),)

    return make_fx(part)(torch.randn(4, 3), torch.randn(3, 2))


@pytest.mark.slow
def test_a_part_compiled_again_is_read_from_the_cache_folder_under_a_key_of_what_it_is_made_of(monkeypatch, tmp_path):
    """The second compile of a part loads the source the first wrote (and computes the same);
    another input shape, another thread count or other inductor options is another key; a cached
    file that does not load is compiled again."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    module, options = tiny_part(), {"pattern_matcher": False}
    torch.manual_seed(0)
    x, w = torch.randn(4, 3), torch.randn(3, 2)

    def compiled_result(example_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        changed = example_w.clone()
        with torch.no_grad():
            (total,) = inductor.compile_part(module, [x, changed], options)([x, changed])
        return total, changed

    reads = inductor.cache_hits()
    first = compiled_result(w)
    assert inductor.cache_hits() == reads and len(list((tmp_path / "eblvm").glob("*.py"))) == 1
    compile_source = inductor._compiled_source

    def no_compile(*args):
        raise AssertionError("compiled again")

    monkeypatch.setattr(inductor, "_compiled_source", no_compile)
    second = compiled_result(w)
    assert inductor.cache_hits() == reads + 1, "the second compile read the kept source"
    monkeypatch.setattr(inductor, "_compiled_source", compile_source)
    expected_w = w.clone()
    (expected,) = module(x, expected_w)
    for got in (first, second):
        torch.testing.assert_close(got[0], expected)
        torch.testing.assert_close(got[1], expected_w)

    key = inductor.source_key(module, [x, w], options)
    assert [p.name for p in (tmp_path / "eblvm").glob("*.py")] == [f"{key}.py"], "kept under its key"
    assert inductor.source_key(module, [x, w.t().contiguous().t()], options) != key, "strides"
    assert inductor.source_key(module, [x[:2], w], options) != key, "shape"
    renamed = copy.deepcopy(module)
    for node in renamed.graph.nodes:
        node.name = f"other_{node.name}"
    renamed.recompile()
    assert renamed.code != module.code and inductor.source_key(renamed, [x, w], options) == key, "names"
    assert inductor.source_key(module, [x, w], {"pattern_matcher": True}) != key, "options"
    for header in (False, True):
        built = {**options, "cpp_cache_precompile_headers": header}
        assert inductor.source_key(module, [x, w], built) == key, "how the kernels are built"
    with torch._inductor.config.patch({"epilogue_fusion": not torch._inductor.config.epilogue_fusion}):
        assert inductor.source_key(module, [x, w], options) != key, "inductor's config"
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert inductor.source_key(module, [x, w], options) != key, "threads"
    finally:
        torch.set_num_threads(threads)

    # the same key in another process, with scalar kernels too (an invalid vector ISA has no name but its address)
    scalar = {"cpp.vec_isa_ok": False}
    program = (
        f"import torch; torch.set_num_threads({torch.get_num_threads()}); from eblvm_core import inductor; "
        "from tests.core.test_inductor import tiny_part; "
        "print(inductor.source_key(tiny_part(), [torch.zeros(4, 3), torch.zeros(3, 2)], {'cpp.vec_isa_ok': False}))"
    )
    other = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == inductor.source_key(module, [x, w], scalar), "stable across processes"

    (path,) = (tmp_path / "eblvm").glob("*.py")
    path.write_text("this is not python")
    third = compiled_result(w)
    torch.testing.assert_close(third[0], expected)
    assert "def call" in path.read_text(), "compiled again and written over"


def test_the_precompiled_header_is_read_by_a_graph_of_many_kernels_or_once_the_machine_has_it(monkeypatch, tmp_path):
    """A graph with a library call between its operations reads inductor's precompiled C++ header;
    a graph of one fused kernel reads it only where the machine holds one (``*.gch`` in inductor's
    folder for them, outside the cache folder)."""
    monkeypatch.setattr("torch._inductor.runtime.cache_dir_utils.default_cache_dir", lambda: str(tmp_path))
    fused = make_fx(lambda x: (x.tanh() * 2).sum())(torch.randn(4, 3)).graph
    library = make_fx(lambda x, w: (x @ w).tanh().sum())(torch.randn(4, 3), torch.randn(3, 2)).graph
    assert not inductor.header_precompiled()
    assert [compiled_module.inductor_options(g)["cpp_cache_precompile_headers"] for g in (fused, library)] == [
        False,
        True,
    ]
    headers = tmp_path / "precompiled_headers"
    headers.mkdir()
    (headers / "abc.h").write_text("#include <torch/csrc/inductor/cpp_prefix.h>\n")
    assert not inductor.header_precompiled(), "a header not yet built"
    (headers / "abc.h.gch").write_bytes(b"")
    assert inductor.header_precompiled()
    assert compiled_module.inductor_options(fused)["cpp_cache_precompile_headers"]


def test_idle_cores_leave_out_a_core_this_process_keeps_busy_and_fall_back_to_the_load_average(monkeypatch):
    """Over a stretch this process spins through, at most cpu_count − 1 cores (and a little for the
    clock's ticks) stood idle; without /proc/stat the reading is cpu_count − the last minute's load."""
    since = inductor.core_clock()
    end = time.monotonic() + 0.5
    while time.monotonic() < end:
        pass
    cores = os.cpu_count() or 1
    assert 0 <= inductor.idle_cores(since) <= cores - 1 + 0.2

    def no_stat(*args, **kwargs):
        raise OSError("no /proc/stat here")

    monkeypatch.setattr("builtins.open", no_stat)
    monkeypatch.setattr(inductor.os, "getloadavg", lambda: (0.75, 0.5, 0.25))
    assert inductor.idle_cores(inductor.core_clock()) == cores - 0.75
