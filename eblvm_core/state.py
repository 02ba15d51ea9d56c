"""What a checkpoint holds of a run, and how it is written and put back: every network, each
role's ``state_dict`` (optimizer, gradient scaler, parameter average), the estimator's own state,
the data stream's position, the RNG streams (of every rank under torchrun), the step, and the
state of model selection and early stopping (the best value of [run] select_metric, its step,
and the evaluations since). The trainer holds a ``RunState`` it trains; ``eblvm eval`` and
``sample`` restore one without training."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eblvm_core import checkpoint as ckpt
from eblvm_core import distributed
from eblvm_core.build import Built
from eblvm_core.data import Batches
from eblvm_core.errors import CheckpointError, ConfigError
from eblvm_core.recipe import Recipe, training_part


class StepSums:
    """The sums of the step metrics since the last log step, kept where the metrics are.

    Tensor metrics are added into 0-d float32 tensors on their device, all of them by one
    ``_foreach_add_`` a step (no host synchronisation, no new tensors); number metrics into Python
    floats. Folded into the same addition, a sentinel adds 0·loss for a tensor ``loss``: it stays 0
    while every loss is finite and turns NaN at the first non-finite one (a finite loss, however
    large, cannot overflow it). The sums are read from the device in one transfer, at log steps and
    at the NaN guard's checks only. A step whose metrics have the last step's keys, each a 0-d
    float32 tensor (a compiled step's), is added by one ``_foreach_addcmul_`` alone (factor 1, the
    sentinel's 0): the same sums to the bit.
    """

    SENTINEL = "\0loss-is-finite"

    def __init__(self):
        self.steps = 0  # the steps summed since the last take
        self.order: dict[str, None] = {}  # metric names since the last take, in the order they first came
        self.tensors: dict[str, Tensor] = {}  # every tensor metric's accumulator (kept, zeroed, across takes)
        self.numbers: dict[str, float] = {}
        self.nonfinite_number = False  # a loss given as a number was not finite
        self._plan: tuple[tuple[str, ...], list[Tensor]] = ((), [])  # the last step's keys and accumulators
        self._fast: tuple[tuple[str, ...], list[Tensor], list[Tensor]] | None = None  # keys, accumulators, factors

    def add(self, metrics: dict[str, Any]) -> None:
        fast = self._fast
        if fast is not None and tuple(metrics) == fast[0]:
            values = list(metrics.values())
            if all(type(v) is Tensor and v.dtype == torch.float32 and v.dim() == 0 for v in values):
                self.steps += 1
                with torch.no_grad():
                    torch._foreach_addcmul_(fast[1], [*values, metrics["loss"]], fast[2])
                return
        self._add(metrics)

    def _add(self, metrics: dict[str, Any]) -> None:
        self.steps += 1
        self._fast = None
        keys, values = [], []
        for k, v in metrics.items():
            self.order.setdefault(k)
            if isinstance(v, Tensor):
                keys.append(k)
                values.append(v if v.dim() == 0 else v.reshape(()))
            else:
                self.numbers[k] = self.numbers.get(k, 0.0) + float(v)
        loss = metrics.get("loss")
        if loss is not None and not isinstance(loss, Tensor) and not math.isfinite(loss):
            self.nonfinite_number = True
        if not keys:
            return
        plan_keys, accumulators = self._plan
        with torch.no_grad():
            if isinstance(loss, Tensor):
                keys.append(self.SENTINEL)
                values.append(loss.reshape(()) * 0)
            if tuple(keys) != plan_keys:
                for k, v in zip(keys, values):
                    if k not in self.tensors:
                        self.tensors[k] = torch.zeros((), dtype=torch.float32, device=v.device)
                accumulators = [self.tensors[k] for k in keys]
                self._plan = (tuple(keys), accumulators)
            torch._foreach_add_(accumulators, [v if v.dtype == torch.float32 else v.float() for v in values])
        every = list(metrics.values())
        if (
            isinstance(loss, Tensor)
            and len(keys) == len(every) + 1
            and all(type(v) is Tensor and v.dtype == torch.float32 and v.dim() == 0 for v in every)
        ):
            ones = [torch.ones((), device=a.device) for a in accumulators[:-1]]
            self._fast = (tuple(metrics), accumulators, [*ones, torch.zeros((), device=accumulators[-1].device)])

    def loss_finite(self) -> bool:
        """Whether every loss since the last ``take`` was finite (reads the sentinel: a synchronisation)."""
        sentinel = self.tensors.get(self.SENTINEL)
        return not self.nonfinite_number and (sentinel is None or float(sentinel) == 0.0)

    def take(self) -> dict[str, float]:
        """The sums by metric name (one transfer from the device), then every sum back to 0, in place."""
        names = [k for k in self.tensors if k != self.SENTINEL]
        tensors = [self.tensors[k] for k in names]
        try:
            read = torch.stack(tensors).tolist() if tensors else []
        except RuntimeError:  # sums on several devices
            read = [float(t) for t in tensors]
        sums = dict(zip(names, read))
        for k, v in self.numbers.items():
            sums[k] = sums.get(k, 0.0) + v
        if self.tensors:
            torch._foreach_zero_(list(self.tensors.values()))
        taken = {k: sums[k] for k in self.order}  # the metrics given since the last take
        self.order, self.numbers, self.nonfinite_number, self._plan = {}, {}, False, ((), [])
        self._fast = None
        self.steps = 0
        return taken

    def state_dict(self) -> dict[str, Any]:
        """The sums since the last take, for a checkpoint: a resumed run's first log record then
        averages the same steps as an uninterrupted run's."""
        return {
            "steps": self.steps,
            "order": list(self.order),
            "tensors": {k: t.detach().clone() for k, t in self.tensors.items()},
            "numbers": dict(self.numbers),
            "nonfinite_number": self.nonfinite_number,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.order = int(state["steps"]), dict.fromkeys(state["order"])
        self.tensors = {k: t.clone() for k, t in state["tensors"].items()}
        self.numbers, self.nonfinite_number = dict(state["numbers"]), bool(state["nonfinite_number"])
        self._plan, self._fast = ((), []), None


class RunState:
    """The trained state of ``built`` as ``recipe`` made it, in process ``rank`` of ``world`` (the plan's).

    With W processes (torchrun) each rank draws its B/W share of every batch; the parameters
    start as rank 0's (broadcast here) and stay equal, as every role's ``update`` averages the
    gradients; a checkpoint keeps every rank's RNG and estimator state. ``best``, ``best_step``
    and ``stale`` are model selection's (the best [run] select_metric so far, its step, and the
    evaluations since), checkpointed with the rest.
    """

    def __init__(self, recipe: Recipe, built: Built):
        rank, world = built.plan.rank, built.plan.world
        self.recipe, self.built, self.rank, self.world = recipe, built, rank, world
        self.parts, self.roles = built.parts, built.roles
        self.estimator = built.parts.estimator
        run = recipe.run
        assert run.seed is not None, "the recipe's seed is chosen and written back before the run is built"
        self.seed: int = run.seed
        if run.batch_size % world:
            raise ConfigError(
                "run",
                "batch_size",
                f"{run.batch_size} is the global batch and must split evenly among {world} processes",
                file=recipe.path,
            )
        self.batches = Batches(
            self.parts.data, run.batch_size, self.seed + 1, self.parts.device, self.parts.dtype, rank, world
        )
        self.step = 0
        self.sums = StepSums()  # the step metrics summed since the last log step (``progress``)
        self.last_saved: tuple[int, Path] | None = None
        self.best: float | None = None
        self.best_step: int | None = None
        self.stale = 0
        self.evaluated_step: int | None = None  # the step of the last finite evaluation
        names = {
            id(p): f"{section}.{n}" for section, net in self.parts.networks().items() for n, p in net.named_parameters()
        }
        self.param_names = {
            name: [names.get(id(p), f"{name} parameter {i}") for i, p in enumerate(role.params)]
            for name, role in self.roles.items()
        }
        if world > 1:  # every rank starts from rank 0's networks and trained tensors
            states = [t for net in self.parts.networks().values() for t in net.state_dict().values()]
            extra = [p for role in self.roles.values() for p in role.params if id(p) not in names]
            distributed.broadcast_(states + extra)
        for role in self.roles.values():
            role.start_average()

    def state(self) -> dict[str, Any]:
        return {
            "format": ckpt.CHECKPOINT_FORMAT,
            "step": self.step,
            "networks": {name: net.state_dict() for name, net in self.parts.networks().items()},
            "roles": {name: role.state_dict() for name, role in self.roles.items()},
            "estimator": self.estimator.state_dict(),
            "data": self.batches.state_dict(),
            "rng": ckpt.rng_state(),
            "best": self.best,
            "best_step": self.best_step,
            "stale": self.stale,
            "evaluated_step": self.evaluated_step,
            "sums": self.sums.state_dict(),
            "recipe": training_part(self.recipe.to_dict()),
        }

    def restore(self, state: dict[str, Any], training: bool = True, source: str | Path = "checkpoint") -> None:
        """Load a checkpoint (from ``ckpt.read_checkpoint``): networks, estimator state and the
        roles' parameter averages always; with ``training`` also the roles' optimizers and
        gradient scalers, the data position, the RNG streams and the selection state (best value,
        its step, evaluations since). A checkpoint that does not fit this run's parts is a
        CheckpointError naming ``source``.

        Each rank takes its own RNG and estimator state (``state["ranks"]``) when the checkpoint
        was written by as many processes; otherwise every rank takes rank 0's estimator state
        and ranks > 0 draw fresh streams, seeded from (seed, step, rank).
        """
        try:
            self._restore(state, training)
        except (KeyError, IndexError, RuntimeError, ValueError, TypeError) as exc:
            what = " ".join(str(exc).split()) or type(exc).__name__
            raise CheckpointError(str(source), f"does not fit this run's parts: {what}") from None
        if training:
            self.last_saved = (self.step, Path(source))

    def _restore(self, state: dict[str, Any], training: bool) -> None:
        for name, net in self.parts.networks().items():
            net.load_state_dict(state["networks"][name])
        ranks = state.get("ranks")
        own = ranks[self.rank] if ranks is not None and len(ranks) == self.world else state
        other_world = own is state
        self.estimator.load_state_dict(own["estimator"])
        for name, role in self.roles.items():
            role.load_state_dict(state["roles"][name], training)
        self.step = int(state["step"])
        if not training:
            return
        self.batches.load_state_dict(state["data"])
        ckpt.set_rng_state(own["rng"])
        if other_world and self.rank:
            ckpt.seed_everything(distributed.rank_seed(self.seed + self.step, self.rank))
        self.best = state.get("best")
        self.best_step = state.get("best_step")
        self.stale = int(state.get("stale", 0))
        self.evaluated_step = state.get("evaluated_step")
        if "sums" in state:  # since the last log step: a resumed run logs what an uninterrupted one does
            self.sums.load_state_dict(state["sums"])

    def save(self, run_dir: Path, last: bool = True, keep: bool = False) -> None:
        """Write checkpoints/last.pt and, with ``keep``, checkpoints/step-<step>.pt in ``run_dir``
        (rank 0, atomically, each sealed with its checksum); with W > 1 it gathers every rank's RNG
        and estimator state into ``state["ranks"]`` (a collective: every rank calls it)."""
        state = self.state()
        if self.world > 1:
            state["ranks"] = distributed.gather({"rng": state["rng"], "estimator": state["estimator"]})
        sealed = ckpt.seal(state) if self.rank == 0 else None
        if keep and self.rank == 0:
            ckpt.save_atomic(sealed, ckpt.kept_checkpoint(run_dir, self.step))
        if last:
            path = ckpt.last_checkpoint(run_dir)
            if self.rank == 0:
                ckpt.save_atomic(sealed, path)
            self.last_saved = (self.step, path)

    def save_best(self, run_dir: Path) -> None:
        """Write checkpoints/best.pt (rank 0 alone evaluates and selects)."""
        ckpt.save_atomic(ckpt.seal(self.state()), ckpt.best_checkpoint(run_dir))

    def out_of_patience(self) -> bool:
        """Whether [run] patience evaluations in a row have not improved on the best select_metric
        (this rank's view: rank 0 alone evaluates)."""
        patience = self.recipe.run.patience
        return patience is not None and self.stale >= patience

    def use_averages(self) -> None:
        """Put every role's parameter average in place for good (evaluating or sampling a saved run)."""
        for role in self.roles.values():
            role.use_average()
