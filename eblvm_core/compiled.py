"""A training step traced once (``make_fx``, backward passes included) into one graph of aten
operations over the run's state, the batch and the step's random numbers, compiled by inductor
and replayed in place. Random draws stay eager, drawn before each call in the eager step's order,
so a compiled step takes the eager step up to float rounding. A step that is not graph-safe or
does what the trace cannot lift is ``Refused``. CONTRIBUTING.md ("How a step is compiled or
captured") has the design."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from eblvm_core import checkpoint as ckpt
from eblvm_core.roles import TrainingRole

aten = torch.ops.aten

UNIFORM = {aten.rand, aten.rand_like}  # random draws at fixed shapes, lifted out of the graph
NORMAL = {aten.randn, aten.randn_like}
LIKE = {aten.rand_like, aten.randn_like}
HOST_READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.item.default}


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
    lr: float,
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
    by the step counts, which the caller has counted up) up to rounding. Updates the parameters
    and moments in place."""
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


DECOMPOSITIONS = {aten._fused_adam_.default: fused_adam}
# inductor's pattern rewrites change what a traced BiSSM step computes (its upper-level loss: -0.54
# against -1.37 eager, from the same state and noise; torch 2.14.1, CPU); the rest of inductor is
# exact to rounding here (tests/core/test_compiled.py checks every compiled estimator against eager)
INDUCTOR = {"pattern_matcher": False}


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


def _random(node: torch.fx.Node) -> bool:
    """Whether a graph node draws random numbers (its operator is tagged as seeded)."""
    return node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def _lift_draws(graph: torch.fx.Graph) -> list[Callable[[], Tensor]]:
    """Turn each random draw of the graph into an input (a Bernoulli draw into a uniform one it is
    compared with); returns how to draw each, in the graph's order. Another kind of draw is a refusal."""
    draws: list[Callable[[], Tensor]] = []
    anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]

    def lifted(kind: Callable[..., Tensor], shape: tuple[int, ...], **kwargs: Any) -> torch.fx.Node:
        nonlocal anchor
        draws.append(lambda: kind(shape, **kwargs))
        with graph.inserting_after(anchor):
            anchor = graph.placeholder(f"draw_{len(draws)}")
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
            node.replace_all_uses_with(lifted(kind, shape, dtype=dtype, device=device, generator=generator))
        elif packet is aten.bernoulli and node.target in (aten.bernoulli.default, aten.bernoulli.p):
            like = node.args[0].meta["val"]
            probability = node.args[0] if node.target is aten.bernoulli.default else node.args[1]
            u = lifted(torch.rand, tuple(like.shape), dtype=like.dtype, device=like.device, generator=generator)
            less = aten.lt.Tensor if isinstance(probability, torch.fx.Node) else aten.lt.Scalar
            with graph.inserting_before(node):
                below = graph.call_function(less, (u, probability))
                sample = graph.call_function(aten._to_copy.default, (below,), {"dtype": like.dtype})
            node.replace_all_uses_with(sample)
        elif node.target is aten.normal_.default and _fresh(node.args[0]):
            filled = node.args[0]
            like = filled.meta["val"]
            mean, std = (list(node.args[1:]) + [node.kwargs.get("mean", 0.0), node.kwargs.get("std", 1.0)])[:2]
            value = lifted(torch.randn, tuple(like.shape), dtype=like.dtype, device=like.device, generator=generator)
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


def _fresh(node: Any) -> bool:
    """Whether a graph node is a tensor made empty by the step itself (filled in place by a draw)."""
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and str(node.target).startswith("aten.empty")


def _drop_profiler_ranges(graph: torch.fx.Graph) -> None:
    """Remove the profiler's range markers (``Optimizer.step#SGD.step``): they compute nothing, and
    what they return is no tensor, which a compiled graph cannot hold."""
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and str(node.target).startswith("profiler."):
            graph.erase_node(node)


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


class CompiledStep:
    """``step(batch) -> metrics`` compiled from the estimator step ``step``, whose state is
    ``tensors`` (``state_tensors``); built by tracing it on ``example`` (a batch of the run's
    shape and dtype), checking the graph and compiling it, the state and the random streams put
    back after each. Raises ``Refused`` when the step cannot be compiled: a host read, a random
    draw it cannot lift, a tensor attribute of ``owner`` (the estimator) it rebinds, a trace or
    compile error."""

    def __init__(
        self, step: Callable[[Tensor], dict[str, Tensor]], tensors: list[Tensor], example: Tensor, owner: Any = None
    ):
        from torch.fx.experimental.proxy_tensor import make_fx

        self.tensors = tensors
        before = _tensor_attributes(owner)

        def traced(batch: Tensor, *state: Tensor) -> dict[str, Tensor]:
            return step(batch)

        with put_back(tensors):
            try:
                module = make_fx(traced, decomposition_table=DECOMPOSITIONS, tracing_mode="real")(example, *tensors)
            except Refused:
                raise
            except Exception as exc:  # whatever the trace met: one line
                raise Refused(f"the trace failed ({type(exc).__name__}: {_first_line(exc)})") from None
            rebound = sorted(k for k, v in _tensor_attributes(owner).items() if before.get(k) is not v)
            for name in rebound:
                setattr(owner, name, before[name])
        if rebound:
            raise Refused(f"the step replaces its tensor {', '.join(rebound)} instead of updating it in place")
        loose = [k for k, v in self._outputs(module, example).items() if not isinstance(v, Tensor)]
        if loose:
            raise Refused(f"the step returns {', '.join(sorted(loose))} as Python numbers")
        _check(module.graph)
        _drop_profiler_ranges(module.graph)
        self.draws = _lift_draws(module.graph)
        module.graph.lint()
        module.recompile()
        self.module = module
        self.compiled = torch.compile(module, fullgraph=True, dynamic=False, options=INDUCTOR)
        with put_back(tensors), torch.no_grad():
            try:
                self.compiled(example, *tensors, *[draw() for draw in self.draws])
            except Exception as exc:  # no C++ compiler, an operation inductor cannot lower...
                raise Refused(f"compiling failed ({type(exc).__name__}: {_first_line(exc)})") from None

    @staticmethod
    def _outputs(module: torch.fx.GraphModule, example: Tensor) -> dict[str, Any]:
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

    def __call__(self, batch: Tensor) -> dict[str, Tensor]:
        draws = [draw() for draw in self.draws]
        with torch.no_grad():
            return self.compiled(batch, *self.tensors, *draws)


def _tensor_attributes(owner: Any) -> dict[str, Tensor]:
    """The tensors ``owner`` holds as attributes, by name."""
    return {k: v for k, v in vars(owner).items() if isinstance(v, Tensor)} if owner is not None else {}


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).strip().splitlines()[:1]) or type(exc).__name__
    return text[:200]


def compile_step(state: Any) -> tuple[CompiledStep | None, str, str]:
    """(compiled step or None, the log's line, what run.json records) for a ``RunState`` on a CPU:
    the step compiled where the plan says so; with ``compile = "auto"`` a step that cannot be
    compiled is the eager one with a warning line, with ``true`` a ConfigError naming [run] compile.
    Made before the run directory is, so a refusal writes nothing."""
    import time

    from eblvm_core.errors import ConfigError

    plan = state.built.plan
    if plan.compile is not None:
        return None, f"compile: eager step: {plan.compile}", f"eager: {plan.compile}"
    start = time.perf_counter()
    try:
        tensors = state_tensors(state.parts.networks(), state.roles, state.estimator)
        step = CompiledStep(state.estimator.step, tensors, state.batches.example(), state.estimator)
    except Refused as exc:
        if plan.compile_required:
            error = ConfigError("run", "compile", f"true, but the step cannot be compiled: {exc}")
            state.recipe.blame(error)
            raise error from None
        return None, f"warning: compile: eager step: {exc}", f"eager: {exc}"
    line = (
        f"compile: the training step is traced into one graph and compiled ({time.perf_counter() - start:.1f} s; "
        f"{len(step.draws)} random draws taken eagerly, in the eager step's order)"
    )
    return step, line, "compiled"
