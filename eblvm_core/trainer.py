"""The training loop: batches, estimator steps, logging, evaluation, checkpoints, resume."""

from __future__ import annotations

import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from eblvm_core import checkpoint as ckpt
from eblvm_core.build import Built
from eblvm_core.errors import ConfigError, TrainingDiverged
from eblvm_core.recipe import Recipe


class BatchStream:
    """Shuffled mini-batches over epochs, from a dedicated generator (its state is checkpointed)."""

    def __init__(self, data: Tensor, batch_size: int, seed: int):
        self.data, self.batch_size = data, min(batch_size, len(data))
        self.generator = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(len(data), generator=self.generator)
        self.pos = 0

    def next(self) -> Tensor:
        if self.pos + self.batch_size > len(self.order):
            self.order = torch.randperm(len(self.data), generator=self.generator)
            self.pos = 0
        idx = self.order[self.pos : self.pos + self.batch_size]
        self.pos += self.batch_size
        return self.data[idx.to(self.data.device)]

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "order": self.order, "pos": self.pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.order, self.pos = state["order"], state["pos"]


def best_checkpoint(run_dir: str | Path) -> Path:
    """Where the checkpoint with the best [run] select_metric is kept."""
    return Path(run_dir) / "checkpoints" / "best.pt"


class Trainer:
    def __init__(self, recipe: Recipe, built: Built, run_dir: Path, echo: Callable[[str], None] = print):
        self.recipe, self.built, self.run_dir, self.echo = recipe, built, Path(run_dir), echo
        self.parts = built.parts
        self.estimator = built.parts.estimator
        self.stream = BatchStream(built.parts.data.train, recipe.run.batch_size, recipe.run.seed + 1)
        self.step = 0
        self.last_saved: tuple[int, Path] | None = None
        self.best: float | None = None  # best select_metric value so far

    # ---- checkpoints -------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        parts = self.parts
        return {
            "step": self.step,
            "model": parts.model.state_dict(),
            "posterior": None if parts.posterior is None else parts.posterior.state_dict(),
            "optimizers": {k: o.state_dict() for k, o in getattr(self.estimator, "optimizers", {}).items()},
            "estimator": self.estimator.state_dict(),
            "data": self.stream.state_dict(),
            "rng": ckpt.rng_state(),
            "best": self.best,
        }

    def restore(self, state: dict[str, Any]) -> None:
        parts = self.parts
        parts.model.load_state_dict(state["model"])
        if parts.posterior is not None and state["posterior"] is not None:
            parts.posterior.load_state_dict(state["posterior"])
        for k, o in getattr(self.estimator, "optimizers", {}).items():
            o.load_state_dict(state["optimizers"][k])
        self.estimator.load_state_dict(state["estimator"])
        self.stream.load_state_dict(state["data"])
        ckpt.set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.best = state.get("best")

    def save(self) -> None:
        path = ckpt.last_checkpoint(self.run_dir)
        ckpt.save_atomic(self.state(), path)
        self.last_saved = (self.step, path)

    # ---- logging -----------------------------------------------------------------------
    def record(self, scalars: dict[str, float], images: dict[str, Tensor] | None = None) -> None:
        with open(self.run_dir / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps({"step": self.step, **scalars}) + "\n")
        for logger in self.built.loggers:
            logger.log_scalars(self.step, scalars)
            if images:
                logger.log_images(self.step, images)

    def evaluate(self) -> dict[str, float]:
        """Run every evaluator without disturbing the training RNG stream."""
        scalars: dict[str, float] = {}
        images: dict[str, Tensor] = {}
        devices = [self.parts.device] if self.parts.device.type == "cuda" else []
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
            raise ConfigError("run", "select_metric", f"no evaluator reports '{run.select_metric}'; reported: {reported}",
                              file=self.recipe.path)
        value = scalars[run.select_metric]
        improved = self.best is None or (value > self.best if run.select_mode == "max" else value < self.best)
        if math.isfinite(value) and improved:
            self.best = value
            ckpt.save_atomic(self.state(), best_checkpoint(self.run_dir))

    def _diverged(self, what: str) -> TrainingDiverged:
        if self.last_saved:
            kept = f"last good checkpoint: {self.last_saved[1]} (step {self.last_saved[0]})"
        else:
            kept = "no checkpoint was written before it"
        return TrainingDiverged(f"step {self.step}: {what}; run stopped, {kept}")

    # ---- the loop ----------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        run = self.recipe.run
        interactive = sys.stderr.isatty()
        bar = None
        if interactive:
            from tqdm import tqdm

            bar = tqdm(total=run.steps, initial=self.step, desc=run.name, dynamic_ncols=True, file=sys.stderr)
        sums: dict[str, float] = defaultdict(float)
        count, tick = 0, time.perf_counter()
        try:
            while self.step < run.steps:
                metrics = self.estimator.step(self.stream.next())
                self.step += 1
                loss = metrics.get("loss", 0.0)
                if not math.isfinite(loss):
                    raise self._diverged(f"training loss is {loss}")
                for k, v in metrics.items():
                    sums[k] += float(v)
                count += 1
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
                if self.step % run.log_every == 0 or self.step == run.steps:
                    means = {f"train/{k}": v / count for k, v in sums.items()}
                    for name, opt in getattr(self.estimator, "optimizers", {}).items():
                        means[f"lr/{name}"] = float(opt.param_groups[0]["lr"])
                    rate = count / max(time.perf_counter() - tick, 1e-9)
                    self.record(means)
                    if bar is None:
                        self.echo(f"step {self.step}/{run.steps}  loss {means.get('train/loss', float('nan')):.5g}  ({rate:.1f} it/s)")
                    sums.clear()
                    count, tick = 0, time.perf_counter()
                if run.eval_every and self.step % run.eval_every == 0 and self.step < run.steps:
                    self.evaluate()
                if self.step % run.checkpoint_every == 0 or self.step == run.steps:
                    bad = [n for n, p in self._named_params() if not torch.isfinite(p).all()]
                    if bad:
                        raise self._diverged(f"parameter {bad[0]} is not finite")
                    self.save()
        finally:
            if bar is not None:
                bar.close()
        return self.evaluate()

    def _named_params(self):
        yield from (("model." + n, p) for n, p in self.parts.model.named_parameters())
        if self.parts.posterior is not None:
            yield from (("posterior." + n, p) for n, p in self.parts.posterior.named_parameters())


def run(
    recipe_path: str | Path | None,
    overrides: list[str] = (),
    device: str | None = None,
    out: str | Path = "runs",
    resume: str | Path | None = None,
    echo: Callable[[str], None] = print,
) -> tuple[Path, dict[str, float]]:
    """Train from a recipe (or continue the run in ``resume``); returns (run_dir, final eval)."""
    import secrets

    import tomli_w

    from eblvm_core.build import build, pick_device
    from eblvm_core.errors import ConfigError
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
    torch_device = pick_device(recipe.run.device)
    if recipe.run.threads:
        torch.set_num_threads(recipe.run.threads)
    ckpt.seed_everything(recipe.run.seed)
    if resume is None:
        run_dir = ckpt.new_run_dir(out, recipe.run.name)
    (run_dir / "recipe.toml").write_text(tomli_w.dumps(recipe.to_dict()))
    built = build(recipe, torch_device, run_dir)
    trainer = Trainer(recipe, built, run_dir, echo)
    if resume is not None:
        trainer.restore(ckpt.load(ckpt.last_checkpoint(run_dir), map_location=torch_device))
        echo(f"resuming {run_dir} at step {trainer.step}")
    else:
        echo(f"run directory: {run_dir}  (seed {recipe.run.seed}, device {torch_device})")
    try:
        results = trainer.fit()
    finally:
        for logger in built.loggers:
            logger.close()
    return run_dir, results
