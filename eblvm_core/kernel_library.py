"""Inductor's CPU kernels of one compiled module built as one C++ library, not a library each.

Inductor writes each fused CPU kernel as a C++ file of its own and builds each with its own
compiler call, which reads the C++ header again (0.5 s precompiled, 2.5 s not) and links again: a
step of convolutions with 33 kernels spent 25 s in the compiler for 2 s of work. ``one_library``
rewrites a module inductor wrote so that its kernels are declared to a ``KernelLibrary``, which
builds them together (one file, or one a compile thread where inductor compiles in parallel) and
puts each kernel's function in the module's namespace before ``call`` first runs. The kernels'
code and their compiler flags are inductor's own; a module whose kernels this does not recognise
is left as it is.

A plain kernel (scalar loops over the standard library's maths: the checkerboard steps) needs
almost nothing of inductor's C++ header, which takes 2.3 s to read unless precompiled. Where no
precompiled header is in use, such kernels are built with ``PLAIN_HEADER`` instead: the main job's
step compiles in 1.3 s instead of 3.0, to the same machine instructions."""

from __future__ import annotations

import ast
import contextlib
import contextvars
import re
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

HEADER = "#include <torch/csrc/inductor/cpp_prefix.h>"
# What a plain kernel uses of inductor's header, declared as that header declares it. c10::convert
# is a plain cast for a float or a double result from a real number, all ``_plain`` lets through.
PLAIN_HEADER = """#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <type_traits>
namespace c10 {
template <typename To, typename From>
inline To convert(From value) {
    static_assert((std::is_same_v<To, float> || std::is_same_v<To, double>) && std::is_arithmetic_v<From>);
    return static_cast<To>(value);
}
}  // namespace c10
inline std::atomic<int>* inductor_cpu_integer_div_error_flag = nullptr;
inline void inductor_cpu_throw_if_integer_div_error(std::atomic<int>& error) {
    if (error.load(std::memory_order_acquire)) throw std::runtime_error("ZeroDivisionError");
}"""
# What a plain kernel calls without a namespace: C++'s statements and casts, and of inductor's header
# only what PLAIN_HEADER declares.
_PLAIN_CALLS = {"for", "if", "while", "return", "sizeof", "decltype", "float", "double", "bool", "int64_t", "int32_t"}
_PLAIN_CALLS |= {"kernel", "inductor_cpu_throw_if_integer_div_error"}
_PLAIN_CONVERTS = {("c10", "convert", "<float>"), ("c10", "convert", "<double>")}
_QUALIFIED = re.compile(r"\b(\w+)::(\w+)(<\w+>)?")
_CALLED = re.compile(r"(?<![\w:.>])([A-Za-z_]\w*)\s*\(")
_SIGNATURE = re.compile(r'extern "C"\s+void\s+kernel\(')
_DECLARATION = re.compile(r"^(\w+) = async_compile\.cpp_pybinding\((\[[^\]]*\]), r'''", re.M)
_WAIT = "\nasync_compile.wait(globals())\n"
# How the binding reads each argument type (a Python object ``{}``) that inductor gives a kernel.
_SCALARS = {
    "int64_t": "PyLong_AsLongLong({})",
    "long": "PyLong_AsLong({})",
    "float": "(float)PyFloat_AsDouble({})",
    "double": "PyFloat_AsDouble({})",
}


@contextlib.contextmanager
def kernels_unbuilt() -> Iterator[None]:
    """Within the block inductor builds no CPU kernel: the module it loads while compiling (to hand
    back its source) gets stand-ins that refuse to run, and ``one_library``'s rewrite of that source
    builds the kernels once, together."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    def refuse(*args: object) -> None:
        raise RuntimeError("an inductor kernel ran before it was built (eblvm_core.kernel_library)")

    def stand_in(cls: type, *args: object, **kwargs: object) -> Callable[[], Callable]:
        return lambda: refuse

    original = CppPythonBindingsCodeCache.__dict__["load_pybinding_async"]
    CppPythonBindingsCodeCache.load_pybinding_async = classmethod(stand_in)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        CppPythonBindingsCodeCache.load_pybinding_async = original  # type: ignore[method-assign]


def one_library(source: str) -> str:
    """Inductor's module ``source`` with its C++ kernels declared to one ``KernelLibrary`` instead
    of built one by one; any other source is returned as it is."""
    declared = list(_DECLARATION.finditer(source))
    wait = source.rfind(_WAIT)
    if not declared or wait < declared[-1].start():
        return source
    for match in declared:
        code = source[match.end() : source.index("''')", match.end())]
        if _binding_arguments(ast.literal_eval(match.group(2))) is None or not _separable(code):
            return source
    start = declared[0].start()
    body = source[start : wait + len(_WAIT)].replace(" = async_compile.cpp_pybinding(", " = _library.kernel(")
    head = "from eblvm_core.kernel_library import KernelLibrary\n_library = KernelLibrary()\n"
    tail = "_library.build(globals())\ndel _library\n"
    return source[:start] + head + body + tail + source[wait + len(_WAIT) :]


def _separable(code: str) -> bool:
    """Whether a kernel's code is the header and one ``extern "C" void kernel(...)``, so that it
    can sit in a namespace of its own beside others."""
    rest = code.replace(HEADER, "", 1)
    return "#include" not in rest and len(_SIGNATURE.findall(rest)) == 1


def _plain(code: str) -> bool:
    """Whether a kernel's code calls only what ``PLAIN_HEADER`` declares: the standard library,
    ``c10::convert`` to float or double, C++'s statements and casts. A name it uses without a call
    and without a namespace, which PLAIN_HEADER does not declare, fails the build, which then reads
    inductor's header (``KernelLibrary._build_file``)."""
    body = code.replace(HEADER, "", 1)
    qualified = _QUALIFIED.findall(body)  # (namespace, name, template argument)
    known = all(space == "std" or (space, name, argument) in _PLAIN_CONVERTS for space, name, argument in qualified)
    return known and set(_CALLED.findall(body)) <= _PLAIN_CALLS


def _binding_arguments(argtypes: Sequence[str]) -> list[str] | None:
    """C++ expressions reading a kernel's arguments from the binding's ``args`` tuple; None for a
    type the binding cannot read."""
    read = []
    for n, argtype in enumerate(argtypes):
        item, bare = f"PyTuple_GET_ITEM(args, {n})", argtype.replace("const ", "").strip()
        if bare.endswith("*"):
            read.append(f"static_cast<{bare}>(tensor_data({item}))")
        elif bare in _SCALARS:
            read.append(_SCALARS[bare].format(item))
        else:
            return None
    return read


class _Declared:
    """A kernel declared to a ``KernelLibrary``: its name in the module until ``build`` replaces it."""

    def __init__(self, index: int):
        self.index = index


class KernelLibrary:
    """The kernels a module declares (``kernel``), built together by ``build``."""

    def __init__(self) -> None:
        self.kernels: list[tuple[list[str], str]] = []

    def kernel(self, argtypes: list[str], code: str) -> _Declared:
        """Declare one of inductor's kernels (its argument types and C++ code, as inductor's
        ``cpp_pybinding`` takes them)."""
        self.kernels.append((argtypes, code))
        return _Declared(len(self.kernels) - 1)

    def build(self, scope: dict[str, Any]) -> None:
        """Build every declared kernel and put its function in ``scope`` in place of its declaration.
        Kernels that need SIMD flags and those that do not are built apart, as inductor builds them,
        and plain ones (``_plain``) apart again, with ``PLAIN_HEADER`` unless inductor's header is
        read precompiled; each group in as many files as inductor's compile threads, built at once."""
        from torch._inductor import config
        from torch._inductor.async_compile import get_compile_threads
        from torch._inductor.codecache import _resolve_needs_vec_isa  # inductor's own reading of the code

        groups: dict[tuple[bool, bool], list[int]] = {}
        for index, (_, code) in enumerate(self.kernels):
            simd = _resolve_needs_vec_isa("cpu", code, None)
            plain = not config.cpp_cache_precompile_headers and _plain(code)
            groups.setdefault((simd, plain), []).append(index)
        threads = max(1, get_compile_threads())
        files = [
            (chunk, plain)
            for (_, plain), indices in groups.items()
            for chunk in _balanced(indices, self.kernels, threads)
            if chunk
        ]
        with ThreadPoolExecutor(max_workers=min(threads, len(files))) as pool:  # each build in a copy of
            futures = [  # this thread's context: its inductor config
                pool.submit(contextvars.copy_context().run, self._build_file, chunk, plain) for chunk, plain in files
            ]
            built = [future.result() for future in futures]
        functions = {index: function for part in built for index, function in part.items()}
        for name, value in list(scope.items()):
            if isinstance(value, _Declared):
                scope[name] = functions[value.index]

    def _build_file(self, indices: list[int], plain: bool) -> dict[int, Callable]:
        """The kernels ``indices`` built as one C++ library with a Python binding for each; with
        ``PLAIN_HEADER`` where ``plain``, and inductor's header should that build fail (a name of
        that header which ``_plain`` cannot see)."""
        from torch._inductor.codecache import CppPythonBindingsCodeCache
        from torch._inductor.exc import CppCompileError

        kernels = [self.kernels[i] for i in indices]
        try:
            module = CppPythonBindingsCodeCache.load(library_source(kernels, PLAIN_HEADER if plain else HEADER))
        except CppCompileError:
            if not plain:
                raise
            module = CppPythonBindingsCodeCache.load(library_source(kernels, HEADER))
        return {index: getattr(module, f"kernel_{n}") for n, index in enumerate(indices)}


def _balanced(indices: list[int], kernels: list[tuple[list[str], str]], files: int) -> list[list[int]]:
    """``indices`` split into ``files`` lists of about equal code length, each in order."""
    loads: list[int] = [0] * files
    chunks: list[list[int]] = [[] for _ in range(files)]
    for index in sorted(indices, key=lambda i: -len(kernels[i][1])):
        lightest = loads.index(min(loads))
        chunks[lightest].append(index)
        loads[lightest] += len(kernels[index][1])
    return [sorted(chunk) for chunk in chunks]


def library_source(kernels: list[tuple[list[str], str]], header: str = HEADER) -> str:
    """One C++ file of ``kernels`` (argument types, inductor's code) after ``header``, kernel ``n``
    in namespace ``kernel_n`` and bound as ``kernel_n`` of a Python module named ``kernel`` (the
    name inductor's loader initialises a module by). Arguments are read as inductor's own bindings
    read them: tensors by the data-pointer function whose address inductor's loader puts in the
    environment."""
    namespaces, bindings, methods = [header], [], []
    for n, (argtypes, code) in enumerate(kernels):
        body = _SIGNATURE.sub("void kernel(", code.replace(HEADER, "", 1), count=1)
        namespaces.append(f"namespace kernel_{n} {{\n{body}\n}}  // namespace kernel_{n}")
        read = "".join(
            f"    auto a{i} = {expression};\n" for i, expression in enumerate(_binding_arguments(argtypes) or ())
        )
        arguments = ", ".join(f"a{i}" for i in range(len(argtypes)))
        bindings.append(_BINDING.format(n=n, count=len(argtypes), read=read, arguments=arguments))
        methods.append(f'    {{"kernel_{n}", call_{n}, METH_VARARGS, nullptr}},')
    return "\n".join(namespaces) + _MODULE.format(bindings="".join(bindings), methods="\n".join(methods))


_BINDING = """
static PyObject* call_{n}(PyObject*, PyObject* args) {{
    if (PyTuple_GET_SIZE(args) != {count}) {{
        PyErr_SetString(PyExc_TypeError, "kernel_{n} takes {count} arguments");
        return nullptr;
    }}
{read}    if (PyErr_Occurred()) return nullptr;
    try {{
        kernel_{n}::kernel({arguments});
    }} catch (const std::exception& error) {{  // a kernel's check (an integer division by zero)
        PyErr_SetString(PyExc_RuntimeError, error.what());
        return nullptr;
    }}
    Py_RETURN_NONE;
}}
"""
_MODULE = """
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cstdlib>
#include <exception>

static void* (*tensor_data)(PyObject*) = nullptr;
{bindings}
static PyMethodDef methods[] = {{
{methods}
    {{nullptr, nullptr, 0, nullptr}}}};
static PyModuleDef module_definition = {{PyModuleDef_HEAD_INIT, "kernel", nullptr, -1, methods}};

PyMODINIT_FUNC PyInit_kernel(void) {{
    const char* address = std::getenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
    if (address == nullptr || std::strtoull(address, nullptr, 10) == 0) {{
        PyErr_SetString(PyExc_RuntimeError, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR is not set");
        return nullptr;
    }}
    tensor_data = reinterpret_cast<void* (*)(PyObject*)>(std::strtoull(address, nullptr, 10));
    return PyModule_Create(&module_definition);
}}
"""
