"""The training loop: batches, estimator steps under the run's precision, schedules, EMA,
logging, evaluation, checkpoints, resume and the NaN guard, the same for every role; under
torchrun the same loop on every rank, rank 0 alone writing and evaluating."""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eblvm_core import checkpoint as ckpt
from eblvm_core import distributed
from eblvm_core.build import Built
from eblvm_core.data import Batches
from eblvm_core.errors import ConfigError, EblvmError, TrainingDiverged
from eblvm_core.optim import optimizer_params
from eblvm_core.recipe import Recipe

CHECKPOINT_FORMAT = 2
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def best_checkpoint(run_dir: str | Path) -> Path:
    """Where the checkpoint with the best [run] select_metric is kept."""
    return Path(run_dir) / "checkpoints" / "best.pt"


class Trainer:
    """Trains ``built`` by ``recipe``; also restores checkpoints for ``eblvm eval`` and ``sample``.

    With W processes (torchrun) each rank draws its B/W share of every batch; the parameters
    start as rank 0's and stay equal, as ``apply_update`` averages every gradient; rank 0 alone
    logs, evaluates and writes checkpoints (which keep every rank's RNG and estimator state).
    """

    def __init__(self, recipe: Recipe, built: Built, run_dir: Path, echo: Callable[[str], None] = print):
        self.recipe, self.built, self.run_dir, self.echo = recipe, built, Path(run_dir), echo
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

    # ---- checkpoints -------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        scalers = {
            role: opt.grad_scaler.state_dict() for role, opt in self.optimizers.items() if hasattr(opt, "grad_scaler")
        }
        return {
            "format": CHECKPOINT_FORMAT,
            "step": self.step,
            "networks": {name: net.state_dict() for name, net in self.parts.networks().items()},
            "optimizers": {role: opt.state_dict() for role, opt in self.optimizers.items()},
            "scalers": scalers,
            "ema": self.ema,
            "estimator": self.estimator.state_dict(),
            "data": self.batches.state_dict(),
            "rng": ckpt.rng_state(),
            "best": self.best,
        }

    def restore(self, state: dict[str, Any], training: bool = True) -> None:
        """Load a checkpoint: networks, estimator state and EMA always; with ``training`` also the
        optimizers, gradient scalers, data position, RNG streams and best value.

        Each rank takes its own RNG and estimator state (``state["ranks"]``) when the checkpoint
        was written by as many processes; otherwise every rank takes rank 0's estimator state
        and ranks > 0 draw fresh streams, seeded from (seed, step, rank).
        """
        if state.get("format") != CHECKPOINT_FORMAT:
            raise EblvmError(
                f"checkpoint format {state.get('format', 1)} is not {CHECKPOINT_FORMAT}: it was written by an older eblvm"
            )
        for name, net in self.parts.networks().items():
            net.load_state_dict(state["networks"][name])
        ranks = state.get("ranks")
        other_world = ranks is None or len(ranks) != self.world
        own = state if other_world else ranks[self.rank]
        self.estimator.load_state_dict(own["estimator"])
        for role, values in state["ema"].items():
            self.ema[role] = [v.to(p) for v, p in zip(values, self.ema[role])]
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

    def save(self) -> None:
        """Write checkpoints/last.pt (rank 0, atomically); with W > 1 it gathers every rank's RNG
        and estimator state into ``state["ranks"]`` (a collective)."""
        state = self.state()
        if self.world > 1:
            state["ranks"] = distributed.gather({"rng": state["rng"], "estimator": state["estimator"]})
        path = ckpt.last_checkpoint(self.run_dir)
        if self.rank == 0:
            ckpt.save_atomic(state, path)
        self.last_saved = (self.step, path)

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

    # ---- logging and evaluation -----------------------------------------------------------
    def record(self, scalars: dict[str, float], images: dict[str, Tensor] | None = None) -> None:
        if self.rank:
            return
        with open(self.run_dir / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps({"step": self.step, **scalars}) + "\n")
        for logger in self.built.loggers:
            logger.log_scalars(self.step, scalars)
            if images:
                logger.log_images(self.step, images)

    def evaluate(self) -> dict[str, float]:
        """Run every evaluator (on EMA weights where enabled) without disturbing the training RNG;
        on rank 0 alone, with collectives off (the other ranks return {} and wait for it at their
        next collective)."""
        if self.rank:
            return {}
        scalars: dict[str, float] = {}
        images: dict[str, Tensor] = {}
        devices = [self.parts.device] if self.parts.device.type == "cuda" else []
        with self.ema_weights(), distributed.local():
            for name, evaluator in self.built.evaluators:
                with torch.random.fork_rng(devices=devices):
                    result = evaluator(self.parts)
                scalars.update({f"eval/{name}/{k}": float(v) for k, v in result.scalars.items()})
                images.update({f"eval/{name}/{k}": v for k, v in result.images.items()})
        if scalars or images:
            self.record(scalars, images)
        self.select(scalars)
        return scalars

    def select(self, scalars: dict[str, float]) -> None:
        """Model selection: save best.pt (atomically) when [run] select_metric improves."""
        run = self.recipe.run
        if run.select_metric is None:
            return
        if run.select_metric not in scalars:
            reported = ", ".join(sorted(scalars)) or "nothing"
            raise ConfigError(
                "run",
                "select_metric",
                f"no evaluator reports '{run.select_metric}'; reported: {reported}",
                file=self.recipe.path,
            )
        value = scalars[run.select_metric]
        improved = self.best is None or (value > self.best if run.select_mode == "max" else value < self.best)
        if math.isfinite(value) and improved:
            self.best = value
            ckpt.save_atomic(self.state(), best_checkpoint(self.run_dir))

    # ---- the NaN guard -------------------------------------------------------------------
    def _diverged(self, what: str) -> TrainingDiverged:
        if self.last_saved:
            kept = f"last good checkpoint: {self.last_saved[1]} (step {self.last_saved[0]})"
        else:
            kept = "no checkpoint was written before it"
        return TrainingDiverged(f"step {self.step}: {what}; run stopped, {kept}")

    def check_parameters(self) -> None:
        """Stop when a parameter of any role is NaN or infinite."""
        for role, opt in self.optimizers.items():
            params = optimizer_params(opt)
            finite = (
                torch.stack([torch.isfinite(p).all() for p in params]) if params else torch.ones(0, dtype=torch.bool)
            )
            if not bool(finite.all()):
                name = self.param_names[role][int((~finite).nonzero()[0])]
                raise self._diverged(f"parameter {name} (role '{role}') is not finite")

    # ---- the loop ----------------------------------------------------------------------
    def set_learning_rates(self) -> None:
        run = self.recipe.run
        for role, opt in self.optimizers.items():
            schedule = self.built.schedules.get(role)
            if schedule is None or not hasattr(opt, "base_lrs"):
                continue
            for group, base in zip(opt.param_groups, opt.base_lrs):
                group["lr"] = schedule.lr(base, self.step, run.steps, self.batches.steps_per_epoch)

    def fit(self) -> dict[str, float]:
        run = self.recipe.run
        bar = None
        if self.rank == 0 and sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(total=run.steps, initial=self.step, desc=run.name, dynamic_ncols=True, file=sys.stderr)
        precision = AUTOCAST.get(run.precision)
        autocast = (
            (lambda: torch.autocast(self.parts.device.type, dtype=precision)) if precision else contextlib.nullcontext
        )
        sums: dict[str, Any] = defaultdict(float)
        count, tick = 0, time.perf_counter()
        loss_ok: Tensor | bool = True
        try:
            while self.step < run.steps:
                self.set_learning_rates()
                batch = self.batches.next()
                with autocast():
                    metrics = self.estimator.step(batch)
                self.update_ema()
                self.step += 1
                loss = metrics.get("loss", 0.0)
                if isinstance(loss, Tensor):
                    loss_ok = torch.isfinite(loss.detach()) & loss_ok
                elif not math.isfinite(loss):
                    if self.world == 1:
                        raise self._diverged(f"training loss is {loss}")
                    loss_ok = False  # every rank stops together at the next check
                for k, v in metrics.items():
                    sums[k] = sums[k] + (v.detach().float() if isinstance(v, Tensor) else float(v))
                count += 1
                if bar is not None:
                    bar.update(1)
                    if not isinstance(loss, Tensor):
                        bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
                log_now = self.step % run.log_every == 0 or self.step == run.steps
                save_now = self.step % run.checkpoint_every == 0 or self.step == run.steps
                if log_now or save_now:
                    if distributed.any_rank(not bool(loss_ok)):
                        raise self._diverged(f"training loss became non-finite after step {self.step - count}")
                    self.check_parameters()
                if log_now:
                    keys = list(sums)  # means over every rank's shard
                    values = distributed.mean_floats([float(sums[k]) / count for k in keys])
                    means = {f"train/{k}": v for k, v in zip(keys, values)}
                    for role, opt in self.optimizers.items():
                        means[f"lr/{role}"] = float(opt.param_groups[0]["lr"])
                        if getattr(opt, "grad_norm_count", 0):
                            means[f"train/grad_norm/{role}"] = float(opt.grad_norm_sum) / opt.grad_norm_count
                            opt.grad_norm_sum, opt.grad_norm_count = 0.0, 0
                    rate = count / max(time.perf_counter() - tick, 1e-9)
                    self.record(means)
                    if bar is None:
                        self.echo(
                            f"step {self.step}/{run.steps}  loss {means.get('train/loss', float('nan')):.5g}  ({rate:.1f} it/s)"
                        )
                    sums.clear()
                    count, tick = 0, time.perf_counter()
                if run.eval_every and self.step % run.eval_every == 0 and self.step < run.steps:
                    self.evaluate()
                if save_now:
                    self.save()
        finally:
            if bar is not None:
                bar.close()
        return self.evaluate()


def run(
    recipe_path: str | Path | None,
    overrides: list[str] = (),
    device: str | None = None,
    out: str | Path = "runs",
    resume: str | Path | None = None,
    echo: Callable[[str], None] = print,
) -> tuple[Path, dict[str, float]]:
    """Train from a recipe (or continue the run in ``resume``); returns (run_dir, final eval).

    Under torchrun every process calls it and joins the process group for the run; ranks > 0
    return an empty evaluation.
    """
    import secrets

    from eblvm_core.build import pick_device
    from eblvm_core.recipe import load_recipe, with_run

    if resume is not None:
        run_dir = Path(resume)
        if not ckpt.last_checkpoint(run_dir).exists():
            raise ConfigError("", None, f"no checkpoint to resume from in {run_dir}", file=str(run_dir))
        recipe = load_recipe(run_dir / "recipe.toml", overrides)
    else:
        recipe = load_recipe(recipe_path, overrides)
        if recipe.run.seed is None:
            recipe = with_run(recipe, seed=secrets.randbelow(2**31))
    if device is not None:
        recipe = with_run(recipe, device=device)
    try:
        torch_device = pick_device(recipe.run.device)
    except ConfigError as exc:
        exc.file = exc.file or recipe.path
        raise
    if recipe.run.threads:
        torch.set_num_threads(recipe.run.threads)
    with distributed.process_group(torch_device) as torch_device:
        return _train(recipe, torch_device, out, resume, echo)


def _train(
    recipe: Recipe, device: torch.device, out: str | Path, resume: str | Path | None, echo: Callable[[str], None]
) -> tuple[Path, dict[str, float]]:
    """``run`` once the recipe and this rank's device are known. Every rank builds from the run's
    seed (rank 0's when it was drawn), then ranks > 0 reseed; rank 0 alone makes the run
    directory, writes and echoes."""
    import tomli_w

    from eblvm_core.build import build, build_loggers
    from eblvm_core.recipe import with_run

    rank, world = distributed.rank(), distributed.world_size()
    if rank:
        echo = lambda _message: None  # noqa: E731
    if world > 1 and resume is None:
        recipe = with_run(recipe, seed=distributed.broadcast_object(recipe.run.seed))
    ckpt.seed_everything(recipe.run.seed)
    built = build(recipe, device)
    if resume is None:
        run_dir = distributed.broadcast_object(ckpt.new_run_dir(out, recipe.run.name) if rank == 0 else None)
    else:
        run_dir = Path(resume)
    if rank == 0:
        (run_dir / "recipe.toml").write_text(tomli_w.dumps(recipe.to_dict()))
        built.loggers = build_loggers(recipe, run_dir)
    trainer = Trainer(recipe, built, run_dir, echo)
    if rank:
        ckpt.seed_everything(distributed.rank_seed(recipe.run.seed, rank))
    if resume is not None:
        trainer.restore(ckpt.load(ckpt.last_checkpoint(run_dir), map_location=device))
        echo(f"resuming {run_dir} at step {trainer.step}")
    else:
        processes = f", {world} processes" if world > 1 else ""
        echo(f"run directory: {run_dir}  (seed {recipe.run.seed}, device {device}{processes})")
    try:
        results = trainer.fit()
    finally:
        for logger in built.loggers:
            logger.close()
    return run_dir, results
