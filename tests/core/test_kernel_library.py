"""Inductor's CPU kernels of one compiled part built as one C++ library (``eblvm_core.kernel_library``):
the rewrite of inductor's module, the library's bindings, a part of many kernels computing what
its graph computes with one compiler call a compile thread, and plain kernels built without
inductor's header."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from eblvm_core import inductor, kernel_library
from eblvm_core.kernel_library import HEADER, PLAIN_HEADER, KernelLibrary, one_library

DOUBLE = f"""{HEADER}
extern "C"  void  kernel(const float* in_ptr0, float* out_ptr0, const int64_t ks0)
{{
    for (int64_t i = 0; i < ks0; ++i) out_ptr0[i] = 2.0f * in_ptr0[i];
}}
"""
SHIFT = f"""{HEADER}
extern "C"  void  kernel(float* in_out_ptr0, const float scale)
{{
    for (int64_t i = 0; i < 4; ++i) in_out_ptr0[i] = in_out_ptr0[i] * scale + 1.0f;
}}
"""

DIVIDE = f"""{HEADER}
extern "C"  void  kernel(float* in_out_ptr0, const int64_t ks0)
{{
    std::atomic<int> divided_by_zero{{ks0 == 0 ? 1 : 0}};  // as inductor's integer division notes one
    inductor_cpu_throw_if_integer_div_error(divided_by_zero);
    in_out_ptr0[0] = static_cast<float>(ks0);
}}
"""


def module_source(*kernels: tuple[list[str], str]) -> str:
    """A module as inductor writes one: kernels declared to ``async_compile``, then waited for."""
    declared = "".join(
        f"cpp_fused_{n} = async_compile.cpp_pybinding({a!r}, r'''{c}''')\n\n" for n, (a, c) in enumerate(kernels)
    )
    tail = "async_compile.wait(globals())\ndel async_compile\n\ndef call(args):\n    pass\n"
    return f"async_compile = AsyncCompile()\n\n{declared}\n{tail}"


def test_a_modules_kernels_are_declared_to_one_library_and_anything_else_is_left_alone():
    double, shift = (["const float*", "float*", "const int64_t"], DOUBLE), (["float*", "const float"], SHIFT)
    source = module_source(double, shift)
    rewritten = one_library(source)
    assert "async_compile.cpp_pybinding(" not in rewritten
    assert rewritten.count(" = _library.kernel(") == 2
    assert rewritten.index("_library.build(globals())") > rewritten.index("async_compile.wait(globals())")
    assert rewritten.endswith("def call(args):\n    pass\n")
    assert one_library(module_source(double)).count(" = _library.kernel(") == 1, "one kernel: its header"
    included = (["float*", "const float"], SHIFT.replace(HEADER, HEADER + "\n#include <cmath>"))
    assert one_library(module_source(double, included)) == module_source(double, included), "an include of its own"
    unread = (["float*", "const bool"], SHIFT)
    assert one_library(module_source(double, unread)) == module_source(double, unread), "an argument type unread"


def test_while_inductor_writes_the_source_its_kernels_are_stand_ins_that_refuse_to_run():
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    original = vars(CppPythonBindingsCodeCache)["load_pybinding_async"]
    with kernel_library.kernels_unbuilt():
        stand_in = CppPythonBindingsCodeCache.load_pybinding(["float*"], SHIFT)
        with pytest.raises(RuntimeError, match="ran before it was built"):
            stand_in(torch.zeros(4))
    assert vars(CppPythonBindingsCodeCache)["load_pybinding_async"] is original


@pytest.mark.slow
def test_a_library_binds_each_kernel_with_its_tensor_and_scalar_arguments(monkeypatch, tmp_path):
    """Kernel n of the library is the kernel declared n-th: tensors reach it as data pointers,
    integers and floats as C++ scalars; the kernels come from one compiler call; a kernel's check
    that fails (inductor's integer division by zero) raises in Python, as inductor's binding does."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("torch._inductor.async_compile.get_compile_threads", lambda: 1)
    library = KernelLibrary()
    scope = {
        "double": library.kernel(["const float*", "float*", "const int64_t"], DOUBLE),
        "shift": library.kernel(["float*", "const float"], SHIFT),
        "divide": library.kernel(["float*", "const int64_t"], DIVIDE),
    }
    built = []
    monkeypatch.setattr(
        KernelLibrary,
        "_build_file",
        lambda self, indices, plain, f=KernelLibrary._build_file: built.append(indices) or f(self, indices, plain),
    )
    library.build(scope)
    assert built == [[0, 1, 2]]
    x, out = torch.arange(5.0), torch.zeros(5)
    scope["double"](x, out, 3)
    assert out.tolist() == [0.0, 2.0, 4.0, 0.0, 0.0]
    y = torch.arange(4.0)
    scope["shift"](y, 0.5)
    assert y.tolist() == [1.0, 1.5, 2.0, 2.5]
    with pytest.raises(TypeError, match="takes 2 arguments"):
        scope["shift"](y)
    scope["divide"](y, 3)
    assert y[0] == 3.0
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        scope["divide"](y, 0)


def many_kernels(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor]:
    """Matrix products between pointwise operations: each pointwise stretch is a kernel of its own."""
    h = (x @ w).tanh() * 2 + 1
    g = (h @ w.t()).sigmoid() - x
    return (((g @ w).exp() - h).square().sum(),)


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
def test_a_part_of_many_kernels_computes_its_graph_with_one_compiler_call_a_thread(monkeypatch, tmp_path, threads):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("torch._inductor.async_compile.get_compile_threads", lambda: threads)
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    loads: list[str] = []  # every C++ library built: inductor's kernels one by one would be here too
    load = CppPythonBindingsCodeCache.load_async.__func__
    monkeypatch.setattr(
        CppPythonBindingsCodeCache,
        "load_async",
        classmethod(lambda cls, code, *a, **k: loads.append(code) or load(cls, code, *a, **k)),
    )
    torch.manual_seed(0)
    x, w = torch.randn(6, 3), torch.randn(3, 3)
    module = make_fx(many_kernels)(x, w)
    with torch.no_grad():
        (got,) = inductor.compile_part(module, [x, w], {"pattern_matcher": False, "cpp.vec_isa_ok": False})([x, w])
    (source,) = (tmp_path / "eblvm").glob("*.py")
    kernels = source.read_text().count(" = _library.kernel(")
    assert kernels >= 3, "the graph should have several kernels"
    assert len(loads) == threads and sum(code.count("\nnamespace kernel_") for code in loads) == kernels
    torch.testing.assert_close(got, many_kernels(x, w)[0])


def test_a_kernel_is_plain_when_it_calls_only_the_standard_library_and_casts_to_float():
    plain = (
        "void kernel(float* out_ptr0) { auto t = c10::convert<float>(out_ptr0[0] < 1.0f); out_ptr0[0] = std::exp(t); }"
    )
    assert kernel_library._plain(f'{HEADER}\nextern "C" {plain}')
    for other in [
        plain.replace("c10::convert<float>", "c10::convert<int64_t>"),  # inductor's header rounds toward zero its way
        plain.replace("std::exp(t)", "at::vec::Vectorized<float>(t)[0]"),
        plain.replace("std::exp(t)", "max_propagate_nan(t, 0.0f)"),  # a helper of inductor's header
    ]:
        assert not kernel_library._plain(other), other


def thresholded(x: torch.Tensor) -> tuple[torch.Tensor]:
    """Pointwise maths and a comparison cast to float: one plain kernel."""
    return (((x < 0.5).float() * x.sigmoid() + x.exp().log1p()).sum(),)


@pytest.mark.slow
@pytest.mark.parametrize("precompiled", [False, True])
def test_a_plain_kernel_reads_the_plain_header_unless_inductors_is_precompiled(monkeypatch, tmp_path, precompiled):
    """Inductor's kernel of a pointwise graph, built with PLAIN_HEADER where no precompiled header
    is in use, computes what the graph computes; with the precompiled header, that header."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    loads: list[str] = []
    load = CppPythonBindingsCodeCache.load_async.__func__
    monkeypatch.setattr(
        CppPythonBindingsCodeCache,
        "load_async",
        classmethod(lambda cls, code, *a, **k: loads.append(code) or load(cls, code, *a, **k)),
    )
    x = torch.linspace(-2.0, 2.0, 37)
    options = {"cpp.vec_isa_ok": False, "cpp_cache_precompile_headers": precompiled}
    with torch.no_grad():
        (got,) = inductor.compile_part(make_fx(thresholded)(x), [x], options)([x])
    (code,) = loads
    assert code.startswith(HEADER if precompiled else PLAIN_HEADER)
    torch.testing.assert_close(got, thresholded(x)[0])


UNSEEN = f"""{HEADER}
extern "C"  void  kernel(float* in_out_ptr0)
{{
    in_out_ptr0[0] = static_cast<float>(IsVecType<float>::value) + 1.0f;  // a name of inductor's header
}}
"""


@pytest.mark.slow
def test_a_kernel_that_does_not_build_with_the_plain_header_is_built_with_inductors(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("torch._inductor.config.cpp_cache_precompile_headers", False)
    assert kernel_library._plain(UNSEEN)  # no call, no namespace: only the build can tell
    library = KernelLibrary()
    scope = {"unseen": library.kernel(["float*"], UNSEEN)}
    library.build(scope)
    y = torch.zeros(1)
    scope["unseen"](y)
    assert y.tolist() == [1.0]
