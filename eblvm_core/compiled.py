"""A training step traced once (``make_fx``, backward passes included) into one graph of aten
operations over the run's state, the batch, the step's random numbers and its scheduled rates,
compiled by inductor (without dynamo: no guards on a call) and replayed in place. Random draws stay
eager, drawn before each call in the eager step's order (a run of same-kind draws in one call), so a
compiled step takes the eager step up to float rounding. A step that is not graph-safe or does what
the trace cannot lift is ``Refused``. CONTRIBUTING.md ("How a step is compiled or captured") has the
design."""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
from torch import Tensor

from eblvm_core import checkpoint as ckpt
from eblvm_core import inductor
from eblvm_core.optim import RateTensors
from eblvm_core.roles import TrainingRole

aten = torch.ops.aten

UNIFORM = {aten.rand, aten.rand_like}  # random draws at fixed shapes, lifted out of the graph
NORMAL = {aten.randn, aten.randn_like}
LIKE = {aten.rand_like, aten.randn_like}
HOST_READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.item.default}
# a matrix product of at most this many multiply-adds is traced as a broadcast product and a sum,
# which inductor fuses with its neighbours: on one CPU thread a call of the library's product costs
# more than the arithmetic of such a small one (docs/benchmarks.md)
SMALL_PRODUCT = 16_384
# a graph whose tensors all have at most this many elements is compiled without SIMD loops: they
# save little on a few hundred numbers and their code generation costs seconds (docs/benchmarks.md)
SCALAR_LOOPS_BELOW = 4_096


class Refused(Exception):
    """Why a step cannot be compiled (its message: one line)."""


def fused_adam(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    state_steps: list[Tensor],
    *,
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    amsgrad: bool,
    maximize: bool,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """``torch._fused_adam_`` written as tensor operations, so the trace records them (its
    functional form does not compile): the same update (Adam with L2 weight decay, bias-corrected
    by the step counts, which the caller has counted up) up to rounding, at a rate given as a number
    or as a 0-d tensor (a scheduled rate, ``RateTensors``). Updates the parameters and moments in place."""
    if amsgrad or grad_scale is not None or found_inf is not None:
        raise Refused("the fused Adam step uses amsgrad or a gradient scaler")
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, state_steps):
        g = -g if maximize else g
        if weight_decay:
            g = g + weight_decay * p
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denominator = v.sqrt() / (1 - beta2**step).sqrt() + eps
        p.sub_(m * (lr / (1 - beta1**step)) / denominator)


def fused_sgd(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffer_list: list[Tensor],
    *,
    weight_decay: float,
    momentum: float,
    lr: float | Tensor,
    dampening: float,
    nesterov: bool,
    maximize: bool,
    is_first_step: bool,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """``torch._fused_sgd_`` written as tensor operations (torch's SGD: weight decay, momentum with
    dampening, Nesterov), at a rate given as a number or a 0-d tensor; the trace takes it for an SGD
    whose rate is scheduled (``CompiledStep``). Updates the parameters and momentum buffers in place."""
    if grad_scale is not None or found_inf is not None:
        raise Refused("the fused SGD step uses a gradient scaler")
    for i, (p, g) in enumerate(zip(params, grads)):
        g = -g if maximize else g
        if weight_decay:
            g = g + weight_decay * p
        if momentum:
            buffer = momentum_buffer_list[i]
            if is_first_step:
                buffer.copy_(g)
            else:
                buffer.mul_(momentum).add_(g, alpha=1 - dampening)
            g = g + momentum * buffer if nesterov else buffer
        p.sub_(g * lr)


def _broadcast_product(a: Tensor, b: Tensor) -> Tensor:
    """a @ b for a (m, k), b (k, n) as Σ_k a[:, k, None]·b[None, k, :]: (m, n)."""
    return (a.unsqueeze(2) * b.unsqueeze(0)).sum(1)


def _small(a: Tensor, b: Tensor) -> bool:
    return a.shape[0] * a.shape[1] * b.shape[-1] <= SMALL_PRODUCT


def small_mm(a: Tensor, b: Tensor) -> Any:
    """``mm`` of a small product as a broadcast product and a sum (fused by inductor); else the op itself."""
    return _broadcast_product(a, b) if _small(a, b) else NotImplemented


def small_addmm(c: Tensor, a: Tensor, b: Tensor, *, beta: float = 1, alpha: float = 1) -> Any:
    """``addmm`` (beta·c + alpha·a @ b) of a small product likewise."""
    if not _small(a, b):
        return NotImplemented
    product = _broadcast_product(a, b)
    return (c if beta == 1 else beta * c) + (product if alpha == 1 else alpha * product)


def foreach_norm(tensors: list[Tensor], ord: float = 2, dtype: torch.dtype | None = None) -> list[Tensor]:
    """``_foreach_norm`` as one ``vector_norm`` a tensor, which inductor fuses (the foreach op is a
    library call per step)."""
    return [torch.linalg.vector_norm(t, ord, dtype=dtype) for t in tensors]


DECOMPOSITIONS: dict[Any, Callable[..., Any]] = {
    aten._fused_adam_.default: fused_adam,
    aten._fused_adam_.tensor_lr: fused_adam,
    aten._fused_sgd_.default: fused_sgd,
    aten._fused_sgd_.tensor_lr: fused_sgd,
    aten.mm.default: small_mm,
    aten.addmm.default: small_addmm,
    aten._foreach_norm.Scalar: foreach_norm,
}
APART_GRACE_S = 10.0  # seconds the other process may take beyond this one's pace: its start, a loaded machine
# inductor's pattern rewrites change what a traced BiSSM step computes (its upper-level loss: -0.54
# against -1.37 eager, from the same state and noise; torch 2.14.1, CPU); the rest of inductor is
# exact to rounding here (tests/core/test_compiled.py checks every compiled estimator against eager).
# Tensors keep the layout the eager step gives them (no channels-last convolutions): a part reads what
# another part returns as the trace saw it (a view of it included). Inductor's own cache of compiled
# graphs is off: eblvm keeps each part's source (inductor.compile_part), and the graph cache's key and
# write cost 0.3 s of CPU a part. A compiled part checks no input's size and strides (inductor's
# size_asserts: some 90 checks a main-job step, a tenth of its time): its inputs are the step's own
# tensors, which keep their shapes, and the batch, which ``CompiledStep.replay`` checks once.
INDUCTOR = {"pattern_matcher": False, "layout_optimization": False, "fx_graph_cache": False, "size_asserts": False}
# SIMD loops, for a graph with a tensor above SCALAR_LOOPS_BELOW elements, use the ISA the CPU's flags
# name, without inductor's trial build of each (seconds on a new machine); scalar loops skip the ISA
# checks altogether. Inductor keeps the first answer for the process: a process that compiled a small
# graph first compiles a larger one with scalar loops too (as fast to compile, slower to run).
SIMD = {"cpp.vec_isa_ok": True}
SCALAR = {"cpp.vec_isa_ok": False}
# Each kernel inductor writes is a C++ file of its own, whose header takes a second or two to read.
# A part with no library call (a convolution, a large matrix product) fuses into one kernel, and its
# header is read once (a plain kernel's, kernel_library.PLAIN_HEADER, in a tenth of the time); one
# with library calls between its operations is many kernels, and reads the header precompiled
# (built once a machine, 150 MB beside inductor's cache: a few seconds, which one kernel would not
# repay; the digits BiMDSM step compiles 3.5 times as fast with it). Once the machine has the
# precompiled header, every part reads it (0.5 s a kernel instead of 2.5).
LIBRARY_CALLS = {
    aten.convolution.default,
    aten.convolution_backward.default,
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
}


def state_tensors(networks: dict[str, torch.nn.Module], roles: dict[str, TrainingRole], estimator: Any) -> list[Tensor]:
    """Every tensor a training step reads and changes that lives across steps: the networks'
    parameters and buffers, each role's parameters (an estimator's own, such as NCE's log Z, too),
    optimizer state and gradient statistics (created here if the first update has not made them
    yet: ``TrainingRole.prepare_state``), and the tensors of the estimator's own state
    (``state_dict``: PCD's chains)."""
    for role in roles.values():
        role.prepare_state()
    found: dict[int, Tensor] = {}
    for net in networks.values():
        found.update({id(t): t for t in (*net.parameters(), *net.buffers())})
    for role in roles.values():
        found.update({id(t): t for t in (*role.params, *role.state_tensors())})
    found.update({id(t): t for t in estimator.state_dict().values() if isinstance(t, Tensor)})
    return list(found.values())


@contextlib.contextmanager
def put_back(tensors: list[Tensor]) -> Iterator[None]:
    """Within the block anything may change ``tensors`` and the random streams; afterwards both
    hold their values from before."""
    saved = [t.detach().clone() for t in tensors]
    rng = ckpt.rng_state()
    try:
        yield
    finally:
        with torch.no_grad():
            for t, value in zip(tensors, saved):
                t.copy_(value)
        ckpt.set_rng_state(rng)


@contextlib.contextmanager
def traced_rates(rates: RateTensors | None) -> Iterator[None]:
    """Within the block the scheduled rates are read from their tensors (``RateTensors.installed``),
    and an SGD among their optimizers takes its fused step, whose tensor rate is arithmetic (torch's
    other SGD steps read a tensor rate on the host), which ``fused_sgd`` writes out for the trace."""
    if rates is None:
        yield
        return
    groups = [g for opt in rates.optimizers if isinstance(opt, torch.optim.SGD) for g in opt.param_groups]
    saved = [g.get("fused") for g in groups]
    for group in groups:
        group["fused"] = True
    try:
        with rates.installed():
            yield
    finally:
        for group, fused in zip(groups, saved):
            group["fused"] = fused


@attrs.frozen
class Draw:
    """One random draw the traced step takes: ``kind`` (``torch.rand`` or ``torch.randn``) of ``shape``."""

    kind: Callable[..., Tensor]
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    generator: torch.Generator | None

    def numel(self) -> int:
        return torch.Size(self.shape).numel()

    def take(self) -> Tensor:
        """The draw, as the eager step takes it."""
        return self.kind(self.shape, dtype=self.dtype, device=self.device, generator=self.generator)


class DrawBuffer:
    """Consecutive draws of one kind that the compiled step takes in one call into one buffer kept
    for the step's life: ``fill()`` draws ``kind(total)`` into it in place, the numbers (and the
    stream's state after them) the draws give one after the other (``merges``, checked on this
    machine by ``fills_exactly``); ``views`` are the draws, reshaped slices of the buffer, which the
    compiled graphs read."""

    def __init__(self, draws: list[Draw]):
        first = draws[0]
        self.draws = tuple(draws)
        shape = first.shape if len(draws) == 1 else (sum(d.numel() for d in draws),)
        self.buffer = torch.empty(shape, dtype=first.dtype, device=first.device)
        self.fill = functools.partial(first.kind, shape, generator=first.generator, out=self.buffer)
        offsets = itertools.accumulate((d.numel() for d in draws), initial=0)
        self.views = (
            [self.buffer]
            if len(draws) == 1
            else [self.buffer[start : start + d.numel()].view(d.shape) for start, d in zip(offsets, draws)]
        )

    def fills_exactly(self) -> bool:
        """Whether ``fill`` gives the numbers the draws give taken one after the other, and leaves the
        stream where they leave it (the stream is put back)."""
        generator = self.draws[0].generator or torch.default_generator
        start = generator.get_state()
        try:
            apart = [d.take() for d in self.draws]
            after_apart = generator.get_state()
            generator.set_state(start)
            self.fill()
            after_fill = generator.get_state()
        finally:
            generator.set_state(start)
        same = all(torch.equal(a, v) for a, v in zip(apart, self.views))
        return same and torch.equal(after_apart, after_fill)


def merges(run: list[Draw]) -> bool:
    """Whether the draws of ``run`` taken as one ``kind(total)`` give the same numbers in the same
    order and leave the stream where they would. A CPU uniform draw takes one number of the stream a
    value, so any run of them does; a normal draw of 16 values or more transforms uniform ones 16 at
    a time (its last 16 again when the count is not a multiple of 16), so a run of them does when
    each but the last is a multiple of 16 and the last has 16 or more. A ``DrawBuffer`` is checked
    on the machine once more before use (``fills_exactly``)."""
    if len(run) < 2:
        return False
    first = run[0]
    if any(
        (d.kind, d.dtype, d.device, d.generator) != (first.kind, first.dtype, first.device, first.generator)
        for d in run
    ):
        return False
    if first.device.type != "cpu":
        return False
    if first.kind is torch.rand:
        return True
    sizes = [d.numel() for d in run]
    return all(n >= 16 and n % 16 == 0 for n in sizes[:-1]) and sizes[-1] >= 16


@contextlib.contextmanager
def _one_fake_mode() -> Iterator[None]:
    """Within the block, ``make_fx`` describes each traced value by a fake tensor of one shared
    mode (the tracing context's). Tracing real tensors, it otherwise makes a new fake mode per
    value, which records the Python stack: 40% of the main job's trace. The graph is the same."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    with tracing(TracingContext(FakeTensorMode(allow_fallback_kernels=True))):
        yield


def _random(node: torch.fx.Node) -> bool:
    """Whether a graph node draws random numbers (its operator is tagged as seeded)."""
    return node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def _lift_draws(graph: torch.fx.Graph) -> list[Draw]:
    """Turn each random draw of the graph into an input (a Bernoulli draw into a uniform one it is
    compared with); returns the draws in the graph's order and their placeholders. Another kind of
    draw is a refusal."""
    draws: list[Draw] = []
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    anchor = placeholders[-1]
    fake = next(
        (n.meta["val"].fake_mode for n in graph.nodes if isinstance(n.meta.get("val"), torch._subclasses.FakeTensor)),
        None,
    )

    def lifted(kind: Callable[..., Tensor], shape: tuple[int, ...], dtype, device, generator) -> torch.fx.Node:
        nonlocal anchor
        draws.append(Draw(kind, shape, dtype, torch.device(device), generator))
        with graph.inserting_after(anchor):
            anchor = graph.placeholder(f"draw_{len(draws)}")
        if fake is not None:
            with fake:
                anchor.meta["val"] = torch.empty(shape, dtype=dtype, device=device)
        return anchor

    for node in [n for n in graph.nodes if _random(n)]:
        packet = node.target.overloadpacket
        generator = node.kwargs.get("generator")
        if packet in UNIFORM or packet in NORMAL:
            like = node.args[0].meta["val"] if packet in LIKE else None
            shape = tuple(like.shape) if like is not None else tuple(node.args[0])
            dtype = node.kwargs.get("dtype") or (like.dtype if like is not None else torch.get_default_dtype())
            device = node.kwargs.get("device") or (like.device if like is not None else torch.device("cpu"))
            kind = torch.rand if packet in UNIFORM else torch.randn
            node.replace_all_uses_with(lifted(kind, shape, dtype, device, generator))
        elif packet is aten.bernoulli and node.target in (aten.bernoulli.default, aten.bernoulli.p):
            like = node.args[0].meta["val"]
            probability = node.args[0] if node.target is aten.bernoulli.default else node.args[1]
            u = lifted(torch.rand, tuple(like.shape), like.dtype, like.device, generator)
            less = aten.lt.Tensor if isinstance(probability, torch.fx.Node) else aten.lt.Scalar
            with graph.inserting_before(node):
                below = graph.call_function(less, (u, probability))
                sample = graph.call_function(aten._to_copy.default, (below,), {"dtype": like.dtype})
            node.replace_all_uses_with(sample)
        elif node.target is aten.normal_.default and _fresh(node.args[0]):
            filled = node.args[0]
            like = filled.meta["val"]
            mean, std = (list(node.args[1:]) + [node.kwargs.get("mean", 0.0), node.kwargs.get("std", 1.0)])[:2]
            value = lifted(torch.randn, tuple(like.shape), like.dtype, like.device, generator)
            with graph.inserting_before(node):
                if std != 1.0:
                    value = graph.call_function(aten.mul.Tensor, (value, std))
                if mean != 0.0:
                    value = graph.call_function(aten.add.Tensor, (value, mean))
            node.replace_all_uses_with(value)
            filled.replace_all_uses_with(value, delete_user_cb=lambda user, drawn=node: user is not drawn)
        else:
            raise Refused(f"it draws random numbers by {node.target}, which is not lifted out of the graph")
        graph.erase_node(node)
    return draws


def _runs(draws: list[Draw]) -> list[list[Draw]]:
    """The draws split into maximal runs that ``merges`` admits (a lone draw is a run of one)."""
    runs: list[list[Draw]] = []
    for draw in draws:
        if runs and merges([*runs[-1], draw]):
            runs[-1].append(draw)
        else:
            runs.append([draw])
    return runs


def draw_buffers(draws: list[Draw]) -> list[DrawBuffer]:
    """The buffers that take ``draws`` in the eager order: one a run that ``merges`` and fills exactly
    on this machine, one a draw otherwise. Raises ``Refused`` where a lone draw's buffer does not fill
    as the draw itself does."""
    buffers: list[DrawBuffer] = []
    for run in _runs(draws):
        together = DrawBuffer(run)
        for buffer in [together] if together.fills_exactly() else [DrawBuffer([d]) for d in run]:
            if not buffer.fills_exactly():
                raise Refused(f"a draw of {buffer.draws[0].kind.__name__} filled in place differs from its eager draw")
            buffers.append(buffer)
    return buffers


def _fresh(node: Any) -> bool:
    """Whether a graph node is a tensor made empty by the step itself (filled in place by a draw)."""
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and str(node.target).startswith("aten.empty")


def _check(graph: torch.fx.Graph) -> None:
    """Refuse a graph that read a value on the host (the trace then fixed a branch taken on it) or
    changed in place a tensor that is not an input (the run's state)."""
    for node in graph.nodes:
        if node.op == "call_function" and node.target in HOST_READS:
            raise Refused(f"the step reads a tensor's value on the host ({node.target}), so its path depends on it")
        if node.op == "get_attr":
            for user in node.users:
                schema = getattr(user.target, "_schema", None)
                if schema is not None and schema.is_mutable:
                    raise Refused(f"the step changes a tensor in place that is not the run's state ({user.target})")


def largest_tensor(graph: torch.fx.Graph) -> int:
    """The most elements of any tensor the graph computes."""
    sizes = [
        n.meta["val"].numel() for n in graph.nodes if n.op == "call_function" and isinstance(n.meta.get("val"), Tensor)
    ]
    return max(sizes, default=0)


def inductor_options(graph: torch.fx.Graph) -> dict[str, Any]:
    """``INDUCTOR``, with scalar loops for a graph of small tensors (``SCALAR_LOOPS_BELOW``), else SIMD,
    and the C++ header precompiled for a graph of many kernels (``LIBRARY_CALLS``) or where the
    machine has precompiled it already."""
    kernels = any(node.target in LIBRARY_CALLS for node in graph.nodes)
    return {
        **INDUCTOR,
        **(SCALAR if largest_tensor(graph) <= SCALAR_LOOPS_BELOW else SIMD),
        "cpp_cache_precompile_headers": kernels or inductor.header_precompiled(),
    }


class CompiledStep:
    """``step(batch) -> metrics`` compiled from the estimator step ``step``, whose state is
    ``tensors`` (``state_tensors``); built by tracing it on ``example`` (a batch of the run's
    shape and dtype), checking the graph, cutting it into parts (``eblvm_core.inductor``: the
    repeats of a step compiled once) and compiling each, the state and the random streams put back
    after each. ``rates`` (``RateTensors``) are the scheduled learning rates: the trace reads them
    from their tensors, which each call fills with the rates the trainer set. Raises ``Refused``
    when the step cannot be compiled: a host read, a random draw it cannot lift, a tensor attribute
    of ``owner`` (the estimator) it rebinds, a trace or compile error.

    ``trace_s`` and ``compile_s`` are the seconds the trace and inductor took; ``draws`` the buffers
    each call fills with the step's random numbers, in the eager step's order; ``calls`` how many
    compiled parts a step calls and ``compiled_parts`` how many distinct ones were compiled;
    ``from_cache`` whether every one of them was read from the compile cache (none compiled)."""

    def __init__(
        self,
        step: Callable[[Tensor], dict[str, Tensor]],
        tensors: list[Tensor],
        example: Tensor,
        owner: Any = None,
        rates: RateTensors | None = None,
    ):
        if getattr(torch._inductor, "compile_to_python", None) is None:
            raise Refused(f"torch {torch.__version__} has no torch._inductor.compile_to_python (torch 2.14 or later)")
        self.rates = rates
        self.tensors = [*tensors, *(rates.tensors() if rates is not None else [])]
        self.batch_layout = _layout(example)
        start, clock = time.perf_counter(), inductor.core_clock()
        module = self._trace(step, example, owner)
        self.draws = draw_buffers(_lift_draws(module.graph))
        self._fills = [buffer.fill for buffer in self.draws]
        inductor.read_through_in_place_results(module.graph)
        output = next(n for n in module.graph.nodes if n.op == "output")
        results, self._structure = torch.utils._pytree.tree_flatten(output.args[0])
        returned = [r for r in results if isinstance(r, torch.fx.Node)]
        parts = inductor.cut(module.graph, inductor.segments(module.graph), returned)
        self.trace_s = time.perf_counter() - start
        start = time.perf_counter()
        self._compile(module, parts, results, example, inductor.idle_cores(clock))
        self.compile_s = time.perf_counter() - start

    def _trace(self, step: Callable[[Tensor], dict[str, Tensor]], example: Tensor, owner: Any) -> torch.fx.GraphModule:
        """The step traced on ``example`` into a checked graph, the state and random streams put back."""
        from torch.fx.experimental.proxy_tensor import make_fx

        def traced(batch: Tensor, *state: Tensor) -> dict[str, Tensor]:
            return step(batch)

        before = _tensor_attributes(owner)
        with put_back(self.tensors), traced_rates(self.rates), _one_fake_mode():
            try:
                module = make_fx(traced, decomposition_table=DECOMPOSITIONS, tracing_mode="real")(
                    example, *self.tensors
                )
            except Refused:
                raise
            except Exception as exc:  # whatever the trace met: one line
                raise Refused(f"the trace failed ({type(exc).__name__}: {_first_line(exc)})") from None
            rebound = sorted(k for k, v in _tensor_attributes(owner).items() if before.get(k) is not v)
            for name in rebound:
                setattr(owner, name, before[name])
        if rebound:
            raise Refused(f"the step replaces its tensor {', '.join(rebound)} instead of updating it in place")
        loose = [k for k, v in self._outputs(module).items() if not isinstance(v, Tensor)]
        if loose:
            raise Refused(f"the step returns {', '.join(sorted(loose))} as Python numbers")
        _check(module.graph)
        return module

    def _compile(
        self,
        module: torch.fx.GraphModule,
        parts: list[inductor.Part],
        results: list[Any],
        example: Tensor,
        idle_cores: float,
    ) -> None:
        """Compile each distinct part once (the smaller ones by another process where ``idle_cores``,
        the cores that stood idle while the step was traced, can run it) and lay out the program a
        call runs: ``_slots`` (the batch, the state, the draws, the constants, then what parts
        return), ``_program`` (each part's call, the slots it reads and those it fills) and
        ``_results`` (the slot or value of each metric)."""
        graph = module.graph
        leaves = [n for n in graph.nodes if n.op == "placeholder"]
        leaves += [n for n in graph.nodes if n.op == "get_attr"]  # tensors the trace met that are no input
        slots = {node: i for i, node in enumerate(leaves)}
        for part in parts:
            slots.update((node, len(slots)) for node in part.outputs)
        discard = len(slots)  # where a compiled twin's value that this part's readers do not need goes
        self._slots: list[Any] = [example, *self.tensors, *(view for b in self.draws for view in b.views)]
        self._slots += [operator.attrgetter(n.target)(module) for n in leaves if n.op == "get_attr"]
        self._slots += [None] * (discard + 1 - len(self._slots))
        self._results = [(slots[r], None) if isinstance(r, torch.fx.Node) else (None, r) for r in results]
        keys = [part.signature() for part in parts]
        returned: dict[tuple, set[int]] = {}  # a signature -> what its compiled part returns (positions in nodes)
        for part, key in zip(parts, keys):
            returned.setdefault(key, set()).update(i for i, n in enumerate(part.nodes) if n in part.outputs)
        self._program: list[tuple[Callable, list[int], list[int]]] = []
        compiled: dict[tuple, Callable] = {}
        with put_back(self.tensors), torch.no_grad():
            for fill in self._fills:
                fill()
            values = dict(zip(leaves, self._slots))
            alone: dict[tuple, tuple[torch.fx.GraphModule, list[Tensor]]] = {}  # each distinct part, on its example
            for part, key in zip(parts, keys):
                positions = sorted(returned[key])
                module_of_part = part.module(module, positions)
                inputs = [values[node] for node in part.inputs]
                alone.setdefault(key, (module_of_part, inputs))
                values.update(zip((part.nodes[i] for i in positions), module_of_part(*inputs)))
            size = {key: len(m.graph.nodes) for key, (m, _) in alone.items()}
            largest = max(size, key=size.__getitem__)
            others = [key for key in alone if key != largest]
            jobs = {key: (m, inputs, inductor_options(m.graph)) for key, (m, inputs) in alone.items()}
            apart = inductor.compile_apart([jobs[k] for k in others if not inductor.is_cached(*jobs[k])], idle_cores)
            started_apart = apart is not None
            try:
                begin, hits = time.perf_counter(), inductor.cache_hits()
                for key in [largest, *others]:
                    if apart is not None and key != largest:
                        # waited for as long as this process would take for the others at its pace on the
                        # largest, not at all where the largest was in the cache (the others are too, then)
                        pace = (time.perf_counter() - begin) / size[largest]
                        cold = inductor.cache_hits() == hits
                        apart.wait(timeout=pace * sum(size[k] for k in others) + APART_GRACE_S if cold else 0.0)
                        apart = None
                    compiled[key] = inductor.compile_part(*jobs[key])
                self.from_cache = not started_apart and inductor.cache_hits() - hits == len(compiled)
                for part, key in zip(parts, keys):
                    writes = [slots.get(part.nodes[i], discard) for i in sorted(returned[key])]
                    self._program.append((compiled[key], [slots[n] for n in part.inputs], writes))
                self.replay(example)
            except Exception as exc:  # no C++ compiler, an operation inductor cannot lower...
                raise Refused(f"compiling failed ({type(exc).__name__}: {_first_line(exc)})") from None
            finally:
                if apart is not None:
                    apart.wait(timeout=0.0)
        self.calls, self.compiled_parts = len(self._program), len(compiled)

    @staticmethod
    def _outputs(module: torch.fx.GraphModule) -> dict[str, Any]:
        """The metrics the traced step returned (their structure: what a call returns)."""
        output = next(n for n in module.graph.nodes if n.op == "output")
        structure = torch.utils._pytree.tree_unflatten(
            [
                a.meta.get("val") if isinstance(a, torch.fx.Node) else a
                for a in torch.utils._pytree.tree_leaves(output.args[0])
            ],
            torch.utils._pytree.tree_structure(output.args[0]),
        )
        return structure if isinstance(structure, dict) else {}

    def replay(self, batch: Tensor) -> dict[str, Tensor]:
        """The compiled parts alone on ``batch``, reading the random numbers the draw buffers hold."""
        self._check_batch(batch)
        return self._run_parts(batch)

    def __call__(self, batch: Tensor) -> dict[str, Tensor]:
        self._check_batch(batch)
        if self.rates is not None:
            self.rates.write()
        for fill in self._fills:
            fill()
        return self._run_parts(batch)

    def _check_batch(self, batch: Tensor) -> None:
        """Raises ValueError for a batch laid out otherwise than the one the step was traced on (the
        parts check no input's size: ``INDUCTOR``)."""
        if _layout(batch) != self.batch_layout:
            raise ValueError(
                f"the compiled step was traced on batches {_describe(self.batch_layout)}, not {_describe(_layout(batch))}"
            )

    def _run_parts(self, batch: Tensor) -> dict[str, Tensor]:
        slots = self._slots
        slots[0] = batch
        with torch.no_grad():
            for call, reads, writes in self._program:
                for i, value in zip(writes, call([slots[j] for j in reads])):
                    slots[i] = value
        return torch.utils._pytree.tree_unflatten(
            [slots[i] if i is not None else value for i, value in self._results], self._structure
        )


def _layout(t: Tensor) -> tuple:
    """What a compiled part assumes of an input: (shape, strides, dtype, device)."""
    return (t.shape, t.stride(), t.dtype, t.device)


def _describe(layout: tuple) -> str:
    shape, strides, dtype, device = layout
    return f"of shape {tuple(shape)}, strides {strides}, {dtype} on {device}"


def _tensor_attributes(owner: Any) -> dict[str, Tensor]:
    """The tensors ``owner`` holds as attributes, by name."""
    return {k: v for k, v in vars(owner).items() if isinstance(v, Tensor)} if owner is not None else {}


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).strip().splitlines()[:1]) or type(exc).__name__
    return text[:200]


COMPILING = (
    "compile: tracing and compiling the training step (seconds to a minute the first time; a run of the "
    "same step after it reads it from the compile cache)"
)


def compile_step(state: Any, say: Callable[[str], None]) -> tuple[CompiledStep | None, str, str]:
    """(compiled step or None, the log's line, what run.json records) for a ``RunState`` on a CPU:
    the step compiled where the plan says so (``say`` gets ``COMPILING`` first, so the console
    says what the seconds before the first step go to); with ``compile = "auto"`` a step that
    cannot be compiled is the eager one with a warning line, with ``true`` a ConfigError naming
    [run] compile. Made before the run directory is, so a refusal writes nothing."""
    from eblvm_core.errors import ConfigError

    plan = state.built.plan
    if plan.compile is not None:
        return None, f"compile: eager step: {plan.compile}", f"eager: {plan.compile}"
    say(COMPILING)
    scheduled = [role.optimizer for role in state.roles.values() if role.scheduled]
    try:
        tensors = state_tensors(state.parts.networks(), state.roles, state.estimator)
        rates = RateTensors(scheduled) if scheduled else None
        step = CompiledStep(state.estimator.step, tensors, state.batches.example(), state.estimator, rates)
    except Refused as exc:
        if plan.compile_required:
            error = ConfigError("run", "compile", f"true, but the step cannot be compiled: {exc}")
            state.recipe.blame(error)
            raise error from None
        return None, f"warning: compile: eager step: {exc}", f"eager: {exc}"
    drawn = sum(len(buffer.draws) for buffer in step.draws)
    graphs = (
        "one graph"
        if step.calls == 1
        else f"{step.calls} calls of {step.compiled_parts} graphs (each repeat of a step compiled once)"
    )
    compiled = "read from the compile cache" if step.from_cache else "compiled"
    line = (
        f"compile: the training step is traced into {graphs} ({step.trace_s:.1f} s) and {compiled} "
        f"({step.compile_s:.1f} s); its {drawn} random draws are taken eagerly in {len(step.draws)} calls, in the "
        "eager step's order" + ("; the scheduled rates are inputs of the graph" if scheduled else "")
    )
    return step, line, "compiled"
