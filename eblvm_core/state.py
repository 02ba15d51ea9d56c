"""What a checkpoint holds of a run, and how it is written and put back: every network, each
role's optimizer, gradient scaler and parameter average (EMA), the estimator's own state, the
data stream's position, the RNG streams (of every rank under torchrun), the step, and the state
of model selection and early stopping (the best value of [run] select_metric, its step, and the
evaluations since). The trainer trains a ``RunState``; ``eblvm eval`` and ``sample`` restore one
without training."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from eblvm_core import checkpoint as ckpt
from eblvm_core import distributed
from eblvm_core.build import Built
from eblvm_core.contracts import EvalResult, Parts, evaluation_mode
from eblvm_core.data import Batches
from eblvm_core.errors import CheckpointError, ConfigError
from eblvm_core.optim import optimizer_params
from eblvm_core.recipe import Recipe, training_part


def call_evaluators(
    parts: Parts, evaluators: Iterable[tuple[str, Any]], announce: Callable[[str], None], keep_rng: bool = False
) -> EvalResult:
    """Call each (name, evaluator) on ``parts`` in ``evaluation_mode`` (with ``keep_rng``, also
    inside a fork of the RNG, so the caller's stream goes on as if nothing had run); an
    evaluator's ``announce`` line goes to ``announce`` as "<name>: <line>" before it starts.
    Scalars and images keyed ``eval/<name>/<key>``."""
    devices = [parts.device] if parts.device.type == "cuda" else []
    scalars: dict[str, float] = {}
    images: dict[str, torch.Tensor] = {}
    for name, evaluator in evaluators:
        line = getattr(evaluator, "announce", None)
        if line:
            announce(f"{name}: {line}")
        rng = torch.random.fork_rng(devices=devices) if keep_rng else contextlib.nullcontext()
        with rng, evaluation_mode(parts.networks().values()):
            result = evaluator(parts)
        scalars.update({f"eval/{name}/{k}": float(v) for k, v in result.scalars.items()})
        images.update({f"eval/{name}/{k}": v for k, v in result.images.items()})
    return EvalResult(scalars, images)


class RunState:
    """The trained state of ``built`` as ``recipe`` made it, in ``run_dir``.

    With W processes (torchrun) each rank draws its B/W share of every batch; the parameters
    start as rank 0's (broadcast here) and stay equal, as ``apply_update`` averages every
    gradient; a checkpoint keeps every rank's RNG and estimator state.
    """

    def __init__(self, recipe: Recipe, built: Built, run_dir: Path):
        self.recipe, self.built, self.run_dir = recipe, built, Path(run_dir)
        self.parts = built.parts
        self.estimator = built.parts.estimator
        self.optimizers: dict[str, torch.optim.Optimizer] = dict(self.estimator.optimizers)
        run = recipe.run
        self.rank, self.world = distributed.rank(), distributed.world_size()
        if run.batch_size % self.world:
            raise ConfigError(
                "run",
                "batch_size",
                f"{run.batch_size} is the global batch and must split evenly among {self.world} processes",
                file=recipe.path,
            )
        self.batches = Batches(
            self.parts.data, run.batch_size, run.seed + 1, self.parts.device, self.parts.dtype, self.rank, self.world
        )
        self.step = 0
        self.last_saved: tuple[int, Path] | None = None
        self.best: float | None = None  # best select_metric value so far
        self.best_step: int | None = None  # the step of the evaluation that gave it
        self.stale = 0  # evaluations since the best one (early stopping: [run] patience)
        names = {
            id(p): f"{section}.{n}" for section, net in self.parts.networks().items() for n, p in net.named_parameters()
        }
        self.param_names = {
            role: [names.get(id(p), f"{role} parameter {i}") for i, p in enumerate(optimizer_params(opt))]
            for role, opt in self.optimizers.items()
        }
        if self.world > 1:  # every rank starts from rank 0's networks and trained tensors
            states = [t for net in self.parts.networks().values() for t in net.state_dict().values()]
            extra = [p for opt in self.optimizers.values() for p in optimizer_params(opt) if id(p) not in names]
            distributed.broadcast_(states + extra)
        self.ema = {
            role: [p.detach().clone() for p in optimizer_params(self.optimizers[role])]
            for role, spec in recipe.optim.items()
            if spec.ema is not None
        }

    def state(self) -> dict[str, Any]:
        scalers = {
            role: opt.grad_scaler.state_dict() for role, opt in self.optimizers.items() if hasattr(opt, "grad_scaler")
        }
        return {
            "format": ckpt.CHECKPOINT_FORMAT,
            "step": self.step,
            "networks": {name: net.state_dict() for name, net in self.parts.networks().items()},
            "optimizers": {role: opt.state_dict() for role, opt in self.optimizers.items()},
            "scalers": scalers,
            "ema": self.ema,
            "estimator": self.estimator.state_dict(),
            "data": self.batches.state_dict(),
            "rng": ckpt.rng_state(),
            "best": self.best,
            "best_step": self.best_step,
            "stale": self.stale,
            "recipe": training_part(self.recipe.to_dict()),
        }

    def restore(self, state: dict[str, Any], training: bool = True, source: str | Path = "checkpoint") -> None:
        """Load a checkpoint (from ``ckpt.read_checkpoint``): networks, estimator state and EMA
        always; with ``training`` also the optimizers, gradient scalers, data position, RNG
        streams and the selection state (best value, its step, evaluations since). A checkpoint
        that does not fit this run's parts is a CheckpointError naming ``source``.

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
        other_world = ranks is None or len(ranks) != self.world
        own = state if other_world else ranks[self.rank]
        self.estimator.load_state_dict(own["estimator"])
        for role, values in state["ema"].items():
            self.ema[role] = [v.to(p) for v, p in zip(values, self.ema[role], strict=True)]
        self.step = int(state["step"])
        if not training:
            return
        for role, opt in self.optimizers.items():
            opt.load_state_dict(state["optimizers"][role])
            if role in state["scalers"]:
                opt.grad_scaler.load_state_dict(state["scalers"][role])
        self.batches.load_state_dict(state["data"])
        ckpt.set_rng_state(own["rng"])
        if other_world and self.rank:
            ckpt.seed_everything(distributed.rank_seed(self.recipe.run.seed + self.step, self.rank))
        self.best = state.get("best")
        self.best_step = state.get("best_step")
        self.stale = int(state.get("stale", 0))

    def save(self, last: bool = True, keep: bool = False) -> None:
        """Write checkpoints/last.pt and, with ``keep``, checkpoints/step-<step>.pt (rank 0,
        atomically, each sealed with its checksum); with W > 1 it gathers every rank's RNG and
        estimator state into ``state["ranks"]`` (a collective: every rank calls it)."""
        state = self.state()
        if self.world > 1:
            state["ranks"] = distributed.gather({"rng": state["rng"], "estimator": state["estimator"]})
        sealed = ckpt.seal(state) if self.rank == 0 else None
        if keep and self.rank == 0:
            ckpt.save_atomic(sealed, ckpt.kept_checkpoint(self.run_dir, self.step))
        if last:
            path = ckpt.last_checkpoint(self.run_dir)
            if self.rank == 0:
                ckpt.save_atomic(sealed, path)
            self.last_saved = (self.step, path)

    def out_of_patience(self) -> bool:
        """Whether [run] patience evaluations in a row have not improved on the best select_metric
        (this rank's view: rank 0 alone evaluates)."""
        patience = self.recipe.run.patience
        return patience is not None and self.stale >= patience

    # ---- EMA ---------------------------------------------------------------------------
    @torch.no_grad()
    def update_ema(self) -> None:
        for role, averages in self.ema.items():
            decay = self.recipe.optim[role].ema
            torch._foreach_lerp_(averages, optimizer_params(self.optimizers[role]), 1.0 - decay)

    @torch.no_grad()
    def use_ema(self) -> None:
        """Put the averaged parameters in place for good (evaluating or sampling a saved run)."""
        for role, averages in self.ema.items():
            torch._foreach_copy_(optimizer_params(self.optimizers[role]), averages)

    @contextlib.contextmanager
    def ema_weights(self) -> Iterator[None]:
        """Within the block, every role with an EMA holds its averaged parameters."""
        saved = {}
        with torch.no_grad():
            for role, averages in self.ema.items():
                params = optimizer_params(self.optimizers[role])
                saved[role] = [p.detach().clone() for p in params]
                torch._foreach_copy_(params, averages)
        try:
            yield
        finally:
            with torch.no_grad():
                for role, values in saved.items():
                    torch._foreach_copy_(optimizer_params(self.optimizers[role]), values)
