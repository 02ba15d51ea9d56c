"""The training loop: batches, estimator steps under the run's precision, schedules, EMA,
logging, evaluation, checkpoints, resume, the NaN guard and Ctrl-C, the same for every role;
under torchrun the same loop on every rank, rank 0 alone writing and evaluating."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import sys
import threading
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
from eblvm_core.contracts import Parts
from eblvm_core.data import Batches
from eblvm_core.errors import (
    CheckpointError,
    ConfigError,
    EblvmError,
    FileSystemError,
    Interrupted,
    TrainingDiverged,
)
from eblvm_core.graphs import WARMUP_STEPS, GraphedStep, graph_refusal
from eblvm_core.optim import optimizer_params, take_mean_grad_norm
from eblvm_core.recipe import Recipe, differences, training_part
from eblvm_core.rundir import Provenance, RunLock, RunLog

CHECKPOINT_FORMAT = 3  # 3: a checksum and the training part of the recipe; 2 (neither) still loads
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
NON_FINITE = re.compile(r"\bnan\b|\binf\b|p_in|finite", re.IGNORECASE)  # what a step fails with on NaN/Inf


SMALL_MODEL = 10_000  # parameters below which one CPU thread is fastest (docs/benchmarks.md)


def set_threads(threads: int, device: torch.device, parts: Parts) -> int:
    """Set torch's CPU threads and return the number in use: ``threads`` when > 0 ([run] threads);
    for 0, one thread on a CPU when the networks hold fewer than SMALL_MODEL parameters (a tiny
    model's steps are many tiny operations, which a second thread only slows: 3-10x on 2 busy
    cores, to the same bits; docs/benchmarks.md), else the current setting."""
    if threads == 0 and device.type == "cpu":
        size = sum(p.numel() for net in parts.networks().values() for p in net.parameters())
        threads = 1 if size < SMALL_MODEL else 0
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def json_row(step: int, scalars: dict[str, float], **extra: Any) -> str:
    """One metrics.jsonl line: valid JSON, non-finite values written as null and listed with
    their value under ``"nonfinite"`` (e.g. ``{"eval/x": "nan"}``)."""
    row: dict[str, Any] = {"step": step, **extra}
    bad = {}
    for key, value in scalars.items():
        if isinstance(value, float) and not math.isfinite(value):
            row[key], bad[key] = None, repr(value)
        else:
            row[key] = value
    if bad:
        row["nonfinite"] = bad
    return json.dumps(row, allow_nan=False)


def check_checkpoint_recipe(state: dict[str, Any], recipe: Recipe, path: str | Path) -> None:
    """Refuse a checkpoint written by another recipe (one that trains something else), naming the first difference."""
    if "recipe" not in state:  # format 2
        return
    for key, theirs, ours in differences(state["recipe"], training_part(recipe.to_dict())):
        raise CheckpointError(
            str(path),
            f"written by another recipe: {key} is {theirs!r} there and {ours!r} in {recipe.path}",
        )


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
        self.stop_signal: str | None = None  # set by SIGINT/SIGTERM: checkpoint and stop after this step
        self.bar: Any = None  # the tqdm progress bar while fit() shows one (on a terminal)
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
            "recipe": training_part(self.recipe.to_dict()),
        }

    def restore(self, state: dict[str, Any], training: bool = True, source: str | Path = "checkpoint") -> None:
        """Load a checkpoint (from ``ckpt.read_checkpoint``): networks, estimator state and EMA
        always; with ``training`` also the optimizers, gradient scalers, data position, RNG
        streams and best value. A checkpoint that does not fit this run's parts is a
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

    def save(self) -> None:
        """Write checkpoints/last.pt (rank 0, atomically); with W > 1 it gathers every rank's RNG
        and estimator state into ``state["ranks"]`` (a collective)."""
        state = self.state()
        if self.world > 1:
            state["ranks"] = distributed.gather({"rng": state["rng"], "estimator": state["estimator"]})
        path = ckpt.last_checkpoint(self.run_dir)
        if self.rank == 0:
            ckpt.save_atomic(ckpt.seal(state), path)
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
            fh.write(json_row(self.step, scalars) + "\n")
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
        start = time.perf_counter()
        with self.ema_weights(), distributed.local():
            for name, evaluator in self.built.evaluators:
                announce = getattr(evaluator, "announce", None)
                if announce:
                    self.say(f"step {self.step}: {name}: {announce}")
                with torch.random.fork_rng(devices=devices):
                    result = evaluator(self.parts)
                scalars.update({f"eval/{name}/{k}": float(v) for k, v in result.scalars.items()})
                images.update({f"eval/{name}/{k}": v for k, v in result.images.items()})
        if scalars or images:
            self.record(scalars, images)
        if scalars and self.step < self.recipe.run.steps:  # the final evaluation is printed by the caller
            values = "  ".join(f"{k.removeprefix('eval/')} {v:.5g}" for k, v in scalars.items())
            self.say(f"eval step {self.step}: {values}  ({time.perf_counter() - start:.1f} s)")
        bad = {k: v for k, v in scalars.items() if not math.isfinite(v)}
        if bad:
            key, value = next(iter(bad.items()))
            raise self._diverged(f"evaluation gave {key} = {value}: the model has degenerated")
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
            ckpt.save_atomic(ckpt.seal(self.state()), best_checkpoint(self.run_dir))

    def say(self, line: str) -> None:
        """Echo a line (and write it to run.log) without breaking the progress bar."""
        if self.bar is None:
            self.echo(line)
            return
        with self.bar.external_write_mode():
            self.echo(line)

    # ---- the NaN guard -------------------------------------------------------------------
    def _diverged(self, what: str, step: int | None = None) -> TrainingDiverged:
        """The error for a divergence at ``step`` (default: the last one taken), saying which checkpoint is kept."""
        if self.last_saved is None:
            kept = "no checkpoint was written before it"
        elif self.last_saved[0] == self.step:
            kept = f"the checkpoint {self.last_saved[1]} holds this step's parameters"
        else:
            kept = f"last good checkpoint: {self.last_saved[1]} (step {self.last_saved[0]})"
        return TrainingDiverged(f"step {self.step if step is None else step}: {what}; run stopped, {kept}")

    def nonfinite_parameter(self) -> str | None:
        """The name of a NaN or infinite trained parameter (any role) or network buffer, else None."""
        for role, opt in self.optimizers.items():
            params = optimizer_params(opt)
            finite = (
                torch.stack([torch.isfinite(p).all() for p in params]) if params else torch.ones(0, dtype=torch.bool)
            )
            if not bool(finite.all()):
                return f"parameter {self.param_names[role][int((~finite).nonzero()[0])]} (role '{role}')"
        for section, net in self.parts.networks().items():
            for name, buffer in net.named_buffers():
                if buffer.is_floating_point() and not bool(torch.isfinite(buffer).all()):
                    return f"buffer {section}.{name}"
        return None

    def check_parameters(self) -> None:
        """Stop when a parameter of any role (or a network buffer) is NaN or infinite."""
        bad = self.nonfinite_parameter()
        if bad is not None:
            raise self._diverged(f"{bad} is not finite")

    def _step_failed(self, exc: Exception) -> TrainingDiverged | None:
        """A step that raised on non-finite values (a NaN probability in a sampler) or with a
        non-finite parameter is a divergence; anything else is a bug (None: re-raise it)."""
        bad = self.nonfinite_parameter()
        message = " ".join(str(exc).split()).split(" (Could this error message be improved?")[0]
        if bad is None and not NON_FINITE.search(message):
            return None
        cause = f"{bad} is not finite" if bad else "a value became non-finite"
        return self._diverged(f"the step failed: {cause} ({type(exc).__name__}: {message[:200]})", self.step + 1)

    # ---- the loop ----------------------------------------------------------------------
    def training_step(self) -> Callable[[Tensor], dict[str, Any]]:
        """The estimator's step; on a GPU wrapped to be replayed from a CUDA graph where it can
        be ([run] cuda_graph), saying in the log which and why."""
        run, device = self.recipe.run, self.parts.device
        if device.type != "cuda":
            return self.estimator.step
        refusal = graph_refusal(self.estimator, self.built.schedules, device, self.world, run.precision, run.cuda_graph)
        if refusal is not None:
            self.say(f"CUDA graph: not used: {refusal}")
            return self.estimator.step
        self.say(f"CUDA graph: the training step is captured after {WARMUP_STEPS} eager steps and replayed")
        return GraphedStep(self.estimator.step, self.optimizers, self.say)

    def set_learning_rates(self) -> None:
        run = self.recipe.run
        for role, opt in self.optimizers.items():
            schedule = self.built.schedules.get(role)
            if schedule is None or not hasattr(opt, "base_lrs"):
                continue
            for group, base in zip(opt.param_groups, opt.base_lrs):
                group["lr"] = schedule.lr(base, self.step, run.steps, self.batches.steps_per_epoch)

    def _stop_if_asked(self, sync_step: bool, saved: bool) -> None:
        """After a step: on SIGINT/SIGTERM write a checkpoint (unless this step did) and stop.
        With several processes the ranks agree at logging and checkpoint steps."""
        stop = self.stop_signal is not None
        if self.world > 1:
            stop = sync_step and distributed.any_rank(stop)
        if not stop:
            return
        if not saved:
            self.save()
        raise Interrupted(
            f"{self.stop_signal or 'a signal on another rank'} at step {self.step}/{self.recipe.run.steps}: "
            f"checkpoint {ckpt.last_checkpoint(self.run_dir)} written; "
            f"resume with: eblvm run --resume {self.run_dir}"
        )

    def fit(self) -> dict[str, float]:
        """Train to [run] steps, then evaluate. Log steps record the mean metrics, learning rates,
        gradient norms and ``speed/steps_per_s`` (training steps per second since the last log
        step, evaluations and checkpoints excluded) and print a line with an ETA."""
        run = self.recipe.run
        if self.rank == 0 and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=run.steps, initial=self.step, desc=run.name, dynamic_ncols=True, file=sys.stderr)
        precision = AUTOCAST.get(run.precision)
        autocast = (
            (lambda: torch.autocast(self.parts.device.type, dtype=precision)) if precision else contextlib.nullcontext
        )
        sums: dict[str, Any] = defaultdict(float)
        count, tick, paused = 0, time.perf_counter(), 0.0  # paused: seconds of evaluations and checkpoints
        session_start, first_step = tick, self.step
        loss_ok: Tensor | bool = True
        training_step = self.training_step()
        try:
            while self.step < run.steps:
                self.set_learning_rates()
                batch = self.batches.next()
                try:
                    with autocast():
                        metrics = training_step(batch)
                except (RuntimeError, ValueError) as exc:
                    diverged = self._step_failed(exc)
                    if diverged is None:
                        raise
                    raise diverged from None
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
                if self.bar is not None:
                    self.bar.update(1)
                    if not isinstance(loss, Tensor):
                        self.bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
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
                        grad_norm = take_mean_grad_norm(opt)
                        if grad_norm is not None:
                            means[f"train/grad_norm/{role}"] = grad_norm
                    now = time.perf_counter()
                    rate = count / max(now - tick - paused, 1e-9)
                    means["speed/steps_per_s"] = rate
                    self.record(means)
                    if self.bar is None:
                        loss_mean = means.get("train/loss", float("nan"))
                        line = f"step {self.step}/{run.steps}  loss {loss_mean:.5g}  ({rate:.1f} it/s"
                        if self.step < run.steps:  # the ETA counts evaluations and checkpoints too
                            left = (now - session_start) / (self.step - first_step) * (run.steps - self.step)
                            line += f", ETA {duration(left)}"
                        self.echo(line + ")")
                    sums.clear()
                    count, tick, paused = 0, now, 0.0
                pause = time.perf_counter()
                if run.eval_every and self.step % run.eval_every == 0 and self.step < run.steps:
                    self.evaluate()
                if save_now:
                    self.save()
                paused += time.perf_counter() - pause
                self._stop_if_asked(log_now or save_now, save_now)
        finally:
            if self.bar is not None:
                self.bar.close()
                self.bar = None
        return self.evaluate()


def duration(seconds: float) -> str:
    """Seconds as '42s', '3m05s' or '2h07m'."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def run(
    recipe_path: str | Path | None,
    overrides: list[str] = (),
    device: str | None = None,
    out: str | Path = "runs",
    resume: str | Path | None = None,
    echo: Callable[[str], None] = print,
) -> tuple[Path, dict[str, float]]:
    """Train from a recipe (or continue the run in ``resume``); returns (run_dir, final eval).

    On resume the overrides may change only ``recipe.RESUMABLE`` keys (steps, intervals, device,
    threads, data root, evaluators, loggers); they are checked, as is the checkpoint, before
    anything is written. Under torchrun every process calls it and joins the process group for
    the run; ranks > 0 return an empty evaluation.
    """
    import secrets

    from eblvm_core.build import pick_device
    from eblvm_core.recipe import check_unchanged, load_recipe, with_run

    if resume is not None:
        run_dir = Path(resume)
        if not ckpt.last_checkpoint(run_dir).exists():
            raise ConfigError("", None, f"no checkpoint to resume from in {run_dir}", file=str(run_dir))
        recipe_file = run_dir / "recipe.toml"
        recipe = load_recipe(recipe_file, overrides)
        check_unchanged(load_recipe(recipe_file), recipe, "when resuming")
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
    with distributed.process_group(torch_device) as torch_device:
        return _train(recipe, torch_device, out, resume, echo)


@contextlib.contextmanager
def stop_on_signals(trainer: Trainer) -> Iterator[None]:
    """Within the block SIGINT and SIGTERM ask the trainer to finish its step, write a checkpoint
    and stop (``Trainer.stop_signal``); a second Ctrl-C aborts at once (KeyboardInterrupt).
    Outside the main thread, signals are left alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: Any) -> None:
        if trainer.stop_signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        trainer.stop_signal = signal.Signals(signum).name

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _clean_metrics(run_dir: Path, step: int, final_pending: bool) -> None:
    """Drop the training rows of metrics.jsonl written after the checkpoint at ``step`` (they are
    written again as training resumes), and the final evaluation's rows when it runs again;
    rows of ``eblvm eval`` (with a "checkpoint" key) stay."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill
        rerun = row.get("step", 0) > step or (
            final_pending and row.get("step") == step and any(k.startswith("eval/") for k in row)
        )
        if "checkpoint" in row or not rerun:
            kept.append(line)
    tmp = path.with_name(".metrics.jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def _write_recipe(recipe: Recipe, run_dir: Path) -> None:
    """The resolved recipe as run_dir/recipe.toml, atomically."""
    import tomli_w

    tmp = run_dir / ".recipe.toml.tmp"
    tmp.write_text(tomli_w.dumps(recipe.to_dict()))
    os.replace(tmp, run_dir / "recipe.toml")


def _on_rank0(work: Callable[[], Any]) -> Any:
    """Run ``work`` on rank 0 and hand its result, or its EblvmError, to every rank (so that a
    refusal on rank 0 stops every rank instead of leaving them waiting at a collective)."""
    outcome: Any = None
    if distributed.rank() == 0:
        try:
            outcome = ("ok", work())
        except EblvmError as exc:
            outcome = ("error", exc)
    outcome = distributed.broadcast_object(outcome)
    if outcome[0] == "error":
        raise outcome[1]
    return outcome[1]


def _train(
    recipe: Recipe, device: torch.device, out: str | Path, resume: str | Path | None, echo: Callable[[str], None]
) -> tuple[Path, dict[str, float]]:
    """``run`` once the recipe and this rank's device are known. Every rank builds from the run's
    seed (rank 0's when it was drawn), then ranks > 0 reseed; rank 0 alone locks and writes the run
    directory and echoes. Nothing is written before the recipe built and, on resume, the
    checkpoint loaded and fitted."""
    from eblvm_core.build import auto_on_cpu, build, build_loggers
    from eblvm_core.recipe import with_run

    rank, world = distributed.rank(), distributed.world_size()
    if rank:
        echo = lambda _message: None  # noqa: E731
    if world > 1 and resume is None:
        recipe = with_run(recipe, seed=distributed.broadcast_object(recipe.run.seed))
    locks: list[RunLock] = []
    try:
        state = None
        if resume is not None:
            run_dir = Path(resume)
            state = _checked_resume(recipe, run_dir, device, locks)
            if state is None:
                echo(
                    f"{run_dir} finished at step {recipe.run.steps}: nothing to do "
                    "(continue it with -o run.steps=N; evaluate it with eblvm eval)"
                )
                return run_dir, {}
        ckpt.seed_everything(recipe.run.seed)
        built = build(recipe, device)
        why_cpu = auto_on_cpu(built, recipe, device) if recipe.run.device == "auto" and device.type == "cuda" else None
        if why_cpu is not None and not torch.distributed.is_initialized():  # torchrun keeps its GPUs
            echo(f"device auto: {why_cpu}; training on the CPU")
            device = torch.device("cpu")
            state = ckpt.to_device(state, device)
            ckpt.seed_everything(recipe.run.seed)
            built = build(recipe, device)
        threads = set_threads(recipe.run.threads, device, built.parts)
        trainer = Trainer(recipe, built, Path(resume or "."), echo)
        if rank:
            ckpt.seed_everything(distributed.rank_seed(recipe.run.seed, rank))
        if state is not None:
            trainer.restore(state, source=ckpt.last_checkpoint(resume))
            del state
        if resume is None:
            run_dir = Path(_on_rank0(lambda: _new_run_dir(out, recipe.run.name, locks)))
        trainer.run_dir = run_dir
        return _fit(recipe, trainer, built, run_dir, device, threads, resume, echo, build_loggers)
    finally:
        for lock in locks:
            lock.release()


def _checked_resume(recipe: Recipe, run_dir: Path, device: torch.device, locks: list[RunLock]) -> dict[str, Any] | None:
    """Lock the run directory (rank 0, the lock goes into ``locks``), remove stale temporary
    checkpoints, load last.pt and check it against the recipe; None when the run has finished and
    nothing is left to do."""
    path = ckpt.last_checkpoint(run_dir)
    loaded: dict[str, Any] = {}

    def check() -> tuple[int, bool]:
        locks.append(RunLock(run_dir).acquire())
        ckpt.remove_stale_temporaries(run_dir)
        loaded["state"] = ckpt.read_checkpoint(path, map_location=device, format=CHECKPOINT_FORMAT)
        check_checkpoint_recipe(loaded["state"], recipe, path)
        return int(loaded["state"]["step"]), Provenance(run_dir).finished

    step, finished = _on_rank0(check)
    if step > recipe.run.steps:
        raise ConfigError("run", "steps", f"{recipe.run.steps} is below the checkpoint's step {step}", file=recipe.path)
    if step == recipe.run.steps and finished:
        return None
    return loaded.get("state") or ckpt.read_checkpoint(path, map_location=device, format=CHECKPOINT_FORMAT)


def _new_run_dir(out: str | Path, name: str, locks: list[RunLock]) -> Path:
    """Create and lock ``<out>/<name>/<timestamp>`` (the lock goes into ``locks``); a
    FileSystemError when ``out`` refuses."""
    try:
        run_dir = ckpt.new_run_dir(out, name)
    except OSError as exc:
        raise FileSystemError(
            f"{exc.filename or out}: cannot create the run directory: {exc.strerror or exc}"
        ) from None
    locks.append(RunLock(run_dir).acquire())
    return run_dir


def _fit(
    recipe: Recipe,
    trainer: Trainer,
    built: Built,
    run_dir: Path,
    device: torch.device,
    threads: int,
    resume: str | Path | None,
    echo: Callable[[str], None],
    build_loggers: Callable[[Recipe, Path], list[Any]],
) -> tuple[Path, dict[str, float]]:
    """Write the run directory's recipe, provenance and log (rank 0), train, and record how it ended."""
    rank, world = trainer.rank, trainer.world
    log = RunLog(run_dir, echo) if rank == 0 else echo
    provenance = Provenance(run_dir) if rank == 0 else None
    status = "failed"
    try:
        try:
            if rank == 0:
                _write_recipe(recipe, run_dir)
                if resume is not None:
                    _clean_metrics(run_dir, trainer.step, trainer.step == recipe.run.steps)
                provenance.start(str(device), world, trainer.step, threads)
                built.loggers = build_loggers(recipe, run_dir)
                if resume is not None:
                    for logger in built.loggers:
                        logger.resume(trainer.step)
        except BaseException as exc:
            if resume is None and rank == 0:
                shutil.rmtree(run_dir, ignore_errors=True)  # a run that could not start leaves nothing
                with contextlib.suppress(OSError):
                    run_dir.parent.rmdir()  # nor an empty <out>/<name>/
            if isinstance(exc, OSError):
                raise FileSystemError(f"{exc.filename or run_dir}: cannot write: {exc.strerror or exc}") from None
            raise
        trainer.echo = log
        for warning in built.parts.warnings:
            log(f"warning: {warning}")
        if resume is not None:
            log(f"resuming {run_dir} at step {trainer.step}")
        else:
            processes = f", {world} processes" if world > 1 else ""
            cpu = f", {threads} CPU thread{'s' * (threads > 1)}" if device.type == "cpu" else ""
            log(f"run directory: {run_dir}  (seed {recipe.run.seed}, device {device}{cpu}{processes})")
        try:
            with stop_on_signals(trainer):
                results = trainer.fit()
        except KeyboardInterrupt:
            raise Interrupted(
                f"interrupted at step {trainer.step} without a checkpoint; "
                f"{_kept(trainer)}; resume with: eblvm run --resume {run_dir}"
            ) from None
        except OSError as exc:
            raise FileSystemError(
                f"{exc.filename or run_dir}: cannot write: {exc.strerror or exc}; {_kept(trainer)}"
            ) from None
        status = "finished"
        if rank == 0:
            for key, value in results.items():
                log.write(f"{key.removeprefix('eval/')}: {value:.6g}")
            for logger in built.loggers:
                if hasattr(logger, "log_hparams"):
                    logger.log_hparams(hyperparameters(recipe), results)
        return run_dir, results
    except BaseException as exc:
        if isinstance(exc, TrainingDiverged):
            status = "diverged"
        elif isinstance(exc, Interrupted):
            status = "interrupted"
        if rank == 0 and isinstance(exc, EblvmError):
            with contextlib.suppress(OSError):
                log.write(f"error: {exc}")
        raise
    finally:
        for logger in built.loggers:
            with contextlib.suppress(Exception):
                logger.close()
        if provenance is not None:
            with contextlib.suppress(OSError):
                provenance.end(status, trainer.step)


def hyperparameters(recipe: Recipe) -> dict[str, float | int | str | bool]:
    """The resolved recipe but its [[eval]] and [[log]] lists, flattened to dotted keys
    (``"optim.model.lr": 0.001``, ``"optim.model.schedule.kind": "constant"``); lists become JSON text."""
    flat: dict[str, float | int | str | bool] = {}

    def walk(node: dict[str, Any], prefix: str) -> None:
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, name + ".")
            elif isinstance(value, (bool, int, float, str)):
                flat[name] = value
            elif value is not None:
                flat[name] = json.dumps(value)

    walk({k: v for k, v in recipe.to_dict().items() if k not in ("eval", "log")}, "")
    return flat


def _kept(trainer: Trainer) -> str:
    if trainer.last_saved is None:
        return "no checkpoint was written"
    return f"{trainer.last_saved[1]} holds step {trainer.last_saved[0]}"
