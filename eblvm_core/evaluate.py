"""Work on a finished run without retraining: rebuild it from RUN_DIR/recipe.toml, load a
checkpoint, then evaluate (``eblvm eval``) or draw samples (``eblvm sample``).

Evaluator results are appended to RUN_DIR/metrics.jsonl as
``{"step": <checkpoint step>, "checkpoint": "<last|best|path>", "eval/<name>/<key>": value, ...}``
and their images are written to RUN_DIR/eval/<name>-<key>-step<step>.png.
"""

from __future__ import annotations

import math
from pathlib import Path

import attrs
import torch
from torch import Tensor

from eblvm_core import checkpoint as ckpt
from eblvm_core.build import Built, _make, build, pick_device
from eblvm_core.config import structure
from eblvm_core.contracts import DataSplits, EvalResult, Parts, Sampler
from eblvm_core.errors import ConfigError, EblvmError
from eblvm_core.plugins import load
from eblvm_core.recipe import Recipe, Section, check_unchanged, load_recipe, with_run
from eblvm_core.trainer import CHECKPOINT_FORMAT, Trainer, best_checkpoint, check_checkpoint_recipe, json_row


@attrs.define
class LoadedRun:
    """A run rebuilt from its recipe with a checkpoint's parameters loaded."""

    run_dir: Path
    recipe: Recipe
    built: Built
    step: int
    checkpoint: str
    seed: int

    @property
    def parts(self) -> Parts:
        return self.built.parts


def resolve_checkpoint(run_dir: Path, which: str) -> Path:
    """``last`` and ``best`` name RUN_DIR/checkpoints/{last,best}.pt; anything else is a path."""
    if which == "last":
        path = ckpt.last_checkpoint(run_dir)
    elif which == "best":
        path = best_checkpoint(run_dir)
    else:
        path = Path(which)
    if not path.exists():
        hint = " (best.pt exists only when the recipe's [run] sets select_metric)" if which == "best" else ""
        raise EblvmError(f"no checkpoint {path}{hint}")
    return path


def load_run(
    run_dir: str | Path, checkpoint: str = "last", device: str | None = None, overrides: list[str] = (), seed: int = 0
) -> LoadedRun:
    """Rebuild the run in ``run_dir`` on ``device`` (default: the recipe's) and load a checkpoint.

    The networks, the estimator's state (e.g. NCE's log-normaliser, PCD's chains) and the EMA
    of each role that keeps one are restored by the trainer's own code, and the EMA weights put
    in place; optimizers are not needed. ``seed`` seeds every RNG afterwards, so evaluations
    and samples are repeatable.
    """
    run_dir = Path(run_dir)
    recipe_path = run_dir / "recipe.toml"
    if not recipe_path.exists():
        raise EblvmError(f"{run_dir} is not a run directory: it has no recipe.toml")
    recipe = load_recipe(recipe_path, overrides)
    check_unchanged(load_recipe(recipe_path), recipe, "when evaluating a trained run")
    if device is not None:
        recipe = with_run(recipe, device=device)
    path = resolve_checkpoint(run_dir, checkpoint)
    torch_device = pick_device(recipe.run.device)
    state = ckpt.read_checkpoint(path, map_location=torch_device, format=CHECKPOINT_FORMAT)
    check_checkpoint_recipe(state, recipe, path)
    built = build(recipe, torch_device)
    trainer = Trainer(recipe, built, run_dir, echo=lambda _line: None)
    trainer.restore(state, training=False, source=path)
    trainer.use_ema()
    ckpt.seed_everything(seed)
    return LoadedRun(run_dir, recipe, built, trainer.step, checkpoint, seed)


def default_sections(names: list[str]) -> list[Section]:
    """Evaluator sections for registry ``names`` with their default configs."""
    registry = load()["evaluators"]
    sections = []
    for name in names:
        entry = registry.get(name, section="--evaluator")
        sections.append(Section(f"eval {name}", entry, structure(entry.config, {}, f"eval {name}")))
    return sections


def run_evaluators(run: LoadedRun, sections: list[Section] | None = None) -> EvalResult:
    """Run the recipe's evaluators, or those of ``sections``: scalars and images keyed
    ``eval/<name>/<key>`` as in training."""
    if sections:
        try:
            evaluators = [(s.kind, _make(s, run.parts)) for s in sections]
        except ConfigError as exc:
            exc.file = exc.file or run.recipe.path
            raise
    else:
        evaluators = run.built.evaluators
    scalars: dict[str, float] = {}
    images: dict[str, Tensor] = {}
    for name, evaluator in evaluators:
        result = evaluator(run.parts)
        scalars.update({f"eval/{name}/{k}": float(v) for k, v in result.scalars.items()})
        images.update({f"eval/{name}/{k}": v for k, v in result.images.items()})
    return EvalResult(scalars, images)


def record(run: LoadedRun, result: EvalResult) -> list[Path]:
    """Append the scalars to metrics.jsonl and write the images as PNG; returns the image paths."""
    from torchvision.utils import save_image

    with open(run.run_dir / "metrics.jsonl", "a") as fh:
        fh.write(json_row(run.step, result.scalars, checkpoint=run.checkpoint) + "\n")
    paths = []
    for key, image in result.images.items():
        path = run.run_dir / "eval" / f"{key.removeprefix('eval/').replace('/', '-')}-step{run.step}.png"
        path.parent.mkdir(exist_ok=True)
        save_image(image.float().cpu(), path)
        paths.append(path)
    return paths


def pick_sampler(run: LoadedRun, name: str | None = None) -> Sampler:
    """The sampler named here, else the recipe's [sampler], else the sampler registered as the
    default for the recipe's model kind (a sampler factory lists those kinds in its
    ``default_for`` attribute, e.g. ``gibbs`` for ``grbm``). Named or default samplers use
    their default configs."""
    registry = load()["samplers"]
    if name is None and run.parts.sampler is not None:
        return run.parts.sampler
    if name is None:
        model_kind = run.recipe.parts["model"].kind
        candidates = [e.name for e in registry.entries() if model_kind in getattr(e.factory, "default_for", ())]
        if not candidates:
            raise EblvmError(
                f"no sampler for model '{model_kind}': add a [sampler] section to the recipe or pass --sampler "
                f"(registered: {', '.join(registry.names()) or 'none'})"
            )
        name = candidates[0]
    entry = registry.get(name, section="--sampler")
    section = Section("sampler", entry, structure(entry.config, {}, "sampler"))
    return _make(section, run.parts)


def scatter_image(points: Tensor, bounds: tuple[tuple[float, float], ...] | None, size: int = 256) -> Tensor:
    """2-D points (n, 2) drawn as dark 3×3-pixel dots on white: (3, size, size), y upwards.

    ``bounds`` ((x_lo, x_hi), (y_lo, y_hi)) fixes the view (the data's box); points outside are
    dropped. Without bounds the view spans the points with a 5% margin.
    """
    points = points.detach().float().cpu()
    if bounds is None:
        lo, hi = points.min(0).values, points.max(0).values
        pad = 0.05 * (hi - lo).clamp_min(1e-6)
        lo, hi = lo - pad, hi + pad
    else:
        lo = torch.tensor([b[0] for b in bounds], dtype=torch.float32)
        hi = torch.tensor([b[1] for b in bounds], dtype=torch.float32)
    pix = ((points - lo) / (hi - lo) * (size - 1)).round().long()
    image = torch.ones(3, size, size)
    colour = torch.tensor([0.12, 0.24, 0.55])
    for dx in (-1, 0, 1):
        for dy in (-1, 0, 1):
            x, y = pix[:, 0] + dx, pix[:, 1] + dy
            inside = (x >= 0) & (x < size) & (y >= 0) & (y < size)
            image[:, size - 1 - y[inside], x[inside]] = colour.unsqueeze(1)
    return image


def samples_image(samples: Tensor, data: DataSplits | None) -> Tensor:
    """Samples as one image (3 or 1, H, W) in [0, 1]: a scatter for 2-D vectors, else a grid of
    images. Image shape: the data's ``image_shape``, its stored shape, or a square side; pixel
    values are mapped by the training data's range."""
    from torchvision.utils import make_grid

    n = len(samples)
    flat = samples.reshape(n, -1).detach().float().cpu()
    if flat.shape[1] == 2:
        return scatter_image(flat, None if data is None else data.bounds)
    shape = getattr(data, "image_shape", None) if data is not None else None
    if shape is None and data is not None and len(data.shape) >= 2:
        shape = data.shape
    if shape is None:
        side = math.isqrt(flat.shape[1])
        shape = (side, side) if side * side == flat.shape[1] else (1, flat.shape[1])
    if len(shape) == 2:
        shape = (1, *shape)
    reference = None if data is None else data.tensor("train", 10000)
    lo, hi = (0.0, 1.0) if reference is None else (float(reference.min()), float(reference.max()))
    images = ((flat - lo) / max(hi - lo, 1e-12)).clamp(0, 1).reshape(n, *shape)
    return make_grid(images, nrow=max(1, math.isqrt(n)), padding=2, pad_value=1.0)


def sample_run(run: LoadedRun, n: int, sampler: str | None = None) -> tuple[Tensor, Tensor]:
    """(samples (n, *event_shape), their image) from the run's model."""
    chosen = pick_sampler(run, sampler)
    generator = torch.Generator(device=run.parts.device).manual_seed(run.seed)
    samples = chosen.sample(run.parts.model, n, generator)
    return samples, samples_image(samples, run.parts.data)
