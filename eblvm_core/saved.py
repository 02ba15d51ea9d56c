"""Work on a finished run without retraining: rebuild it from RUN_DIR/recipe.toml, load a
checkpoint (last, best, one kept at step N, or a file), then evaluate (``eblvm eval``) or draw
samples (``eblvm sample``: an image, the raw samples and the sampler's diagnostics as JSON);
``LoadedRun`` is also what ``eblvm.load`` gives a Python session.

Evaluator results are appended to RUN_DIR/metrics.jsonl as
``{"step": <checkpoint step>, "checkpoint": "<last|best|step:N|path>", "eval/<name>/<key>": value, ...}``,
logged to the run's [[log]] loggers (TensorBoard) at the checkpoint's step under the training's
tags, and their images are written to RUN_DIR/eval/<name>-<key>-step<step>.png.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import Tensor

from eblvm_core import checkpoint as ckpt
from eblvm_core.build import Built, _make, build, build_loggers, plan_for
from eblvm_core.config import structure
from eblvm_core.contracts import DataSplits, Draw, EvalResult, Parts, Sampler
from eblvm_core.errors import ConfigError, EblvmError
from eblvm_core.evaluation import evaluate
from eblvm_core.plan import use_threads
from eblvm_core.plot import image_grid, render, scatter
from eblvm_core.plugins import load
from eblvm_core.recipe import Recipe, Section, check_unchanged, load_recipe, with_run
from eblvm_core.rundir import RECIPE, append_metrics, find_run_dir
from eblvm_core.state import RunState


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


@attrs.define
class LoadedRun:
    """A run rebuilt from its recipe with a checkpoint's parameters loaded (the EMA weights in
    place where a role keeps them), at ``step``: its ``model``, ``posterior``, ``data`` and every
    other part in ``parts``, the ``sampler`` that ``eblvm sample`` uses, and ``evaluate`` and
    ``sample``, which give what ``eblvm eval`` and ``eblvm sample`` give for the same seed."""

    run_dir: Path
    recipe: Recipe
    built: Built
    step: int
    checkpoint: str
    seed: int

    @property
    def parts(self) -> Parts:
        return self.built.parts

    @property
    def model(self) -> Any:
        """The energy model (the recipe's [model]), an nn.Module."""
        return self.parts.model

    @property
    def posterior(self) -> Any:
        """The variational posterior q(h|v) ([posterior]), or None when the recipe has none."""
        return self.parts.posterior

    @property
    def data(self) -> DataSplits:
        """The data splits ([data]): ``data.train``, ``data.test``, ``data.val``, ``data.tensor(split, n)``."""
        return self.parts.data

    @property
    def sampler(self) -> Sampler:
        """The sampler ``eblvm sample`` uses (``pick_sampler``): ``sampler.sample(model, n, generator)``."""
        return pick_sampler(self)[0]

    def evaluate(
        self,
        evaluators: Sequence[str | Mapping[str, Any]] | None = None,
        seed: int | None = None,
        record: bool = False,
        echo: Callable[[str], None] | None = print,
    ) -> EvalResult:
        """Run the recipe's evaluators, or ``evaluators`` (names such as ``"ais-loglik"``, or
        [[eval]] tables such as ``{"kind": "ais-loglik", "n_chains": 500}``), with every RNG
        seeded by ``seed`` (default: the run's, as given to ``load``) first, so repeated calls
        agree with each other and with ``eblvm eval``. Returns scalars and images keyed
        ``eval/<name>/<key>``. ``record`` does what ``eblvm eval`` does with them (metrics.jsonl,
        the [[log]] loggers, PNG files); ``echo`` gets a line before a long evaluator starts."""
        chosen = (
            self.built.evaluators if evaluators is None else [_evaluator(self, t, i) for i, t in enumerate(evaluators)]
        )
        ckpt.seed_everything(self.seed if seed is None else seed)
        result = evaluate(self.parts, chosen, echo or (lambda _line: None))
        if record:
            _record(self, result)
        return result

    def sample(self, n: int = 64, sampler: str | None = None, seed: int | None = None) -> Tensor:
        """``n`` samples (n, *event_shape) from the model, drawn by the sampler ``eblvm sample``
        uses (or the sampler named ``sampler``) from a generator seeded by ``seed`` (default: the
        run's): the raw samples ``eblvm sample`` writes for the same seed. ``draw`` gives them with
        the sampler's diagnostics."""
        return self.draw(n, sampler, seed).samples

    def draw(self, n: int = 64, sampler: str | None = None, seed: int | None = None) -> Draw:
        """``sample(n, sampler, seed)``'s samples with the diagnostics of the chains that drew them
        (``Draw.diagnostics``: acceptance, ESS and split R-hat..., what ``eblvm sample`` prints and
        writes to its .json file; empty for a sampler that reports none)."""
        chosen = pick_sampler(self, sampler)[0]
        generator = torch.Generator(device=self.parts.device).manual_seed(self.seed if seed is None else seed)
        return chosen.draw(self.parts.model, n, generator)

    def sample_image(self, n: int = 64, sampler: str | None = None, seed: int | None = None) -> Tensor:
        """``sample(n, sampler, seed)`` as the image ``eblvm sample`` saves of them (``samples_image``):
        a scatter for 2-D data, else a grid; (3, H, W) in [0, 1]."""
        return samples_image(self.sample(n, sampler, seed), self.parts.data)


def _evaluator(run: LoadedRun, table: str | Mapping[str, Any], index: int) -> tuple[str, Any]:
    """(name, evaluator) built on the run's parts from a name or an [[eval]] table; errors name ``eval.<index>``."""
    label = f"eval.{index}"
    body = {"kind": table} if isinstance(table, str) else dict(table)
    if not isinstance(body.get("kind"), str):
        raise ConfigError(label, "kind", f"missing; choose one of: {', '.join(load()['evaluators'].names())}")
    entry = load()["evaluators"].get(body.pop("kind"), section=label)
    try:
        return entry.name, _make(Section(label, entry, structure(entry.config, body, label)), run.parts)
    except ConfigError as exc:
        exc.file = exc.file or run.recipe.path
        raise


def resolve_checkpoint(run_dir: Path, which: str) -> Path:
    """``last`` and ``best`` name RUN_DIR/checkpoints/{last,best}.pt, ``step:N`` the checkpoint
    kept at step N ([run] keep_every: checkpoints/step-N.pt); anything else is a path."""
    if which == "last":
        path = ckpt.last_checkpoint(run_dir)
    elif which == "best":
        path = ckpt.best_checkpoint(run_dir)
    elif which.startswith("step:"):
        number = which.removeprefix("step:")
        if not number.isdigit():
            raise EblvmError(f"checkpoint '{which}': step:N takes a step number, e.g. step:5000")
        path = ckpt.kept_checkpoint(run_dir, int(number))
        if not path.exists():
            kept = ckpt.kept_steps(run_dir)
            have = (
                "kept: " + ", ".join(f"step:{step}" for step in kept)
                if kept
                else "none is kept ([run] keep_every = N keeps one every N steps)"
            )
            raise EblvmError(f"no checkpoint {which} in {run_dir}: {have}")
        return path
    else:
        path = Path(which)
    if not path.exists():
        hint = " (best.pt exists only when the recipe's [run] sets select_metric)" if which == "best" else ""
        raise EblvmError(f"no checkpoint {path}{hint}")
    return path


def load_run(
    run_dir: str | Path,
    checkpoint: str = "last",
    device: str | None = None,
    overrides: Sequence[str] = (),
    seed: int = 0,
    evals: list[dict[str, Any]] | None = None,
    echo: Callable[[str], None] = _stderr,
) -> LoadedRun:
    """Rebuild the run in ``run_dir`` on ``device`` (default: the recipe's) and load a checkpoint
    (``resolve_checkpoint``). A run's name folder (``runs/<name>``) gives its latest run, which
    ``echo`` names; a missing path and a folder that is not a run are distinct errors.

    ``evals`` ([[eval]] tables such as ``{"kind": "ais-loglik"}``) replace the recipe's evaluators
    before the overrides apply, so ``eval.0.n_chains=100`` sets an option of the first of them.
    Overrides may change what a resume may change and the [sampler]. The networks, the
    estimator's state (e.g. NCE's log-normaliser, PCD's chains) and the parameter average of
    each role that keeps one are restored as training restores them (``state.RunState``), and the
    averages put in place; the roles' optimizers are not needed. The networks are left in eval mode. ``seed`` seeds every RNG
    afterwards, so evaluations and samples are repeatable.
    """
    run_dir, note = find_run_dir(run_dir)
    if note is not None:
        echo(note)
    recipe_path = run_dir / RECIPE
    original = load_recipe(recipe_path)
    recipe = load_recipe(recipe_path, overrides, evals=evals)
    check_unchanged(original, recipe, "when evaluating a trained run", also=("sampler",))
    recipe = with_run(recipe, select_metric=None, patience=None)  # nothing is selected here, whichever evaluators run
    if device is not None:
        recipe = with_run(recipe, device=device)
    path = resolve_checkpoint(run_dir, checkpoint)
    plan = plan_for(recipe)
    state = ckpt.read_checkpoint(path, map_location=plan.device)
    ckpt.check_checkpoint_recipe(state, original, path)
    built = build(recipe, plan)
    use_threads(plan)
    restored = RunState(recipe, built)
    restored.restore(state, training=False, source=path)
    restored.use_averages()
    for net in built.parts.networks().values():
        net.eval()  # as training evaluates: batch norm's running statistics, no power iteration
    ckpt.seed_everything(seed)
    return LoadedRun(run_dir, recipe, built, restored.step, checkpoint, seed)


def evaluator_tables(names: list[str]) -> list[dict[str, Any]]:
    """[[eval]] tables ``{"kind": name}`` for registry names (a misspelt name is an error naming --evaluator)."""
    registry = load()["evaluators"]
    return [{"kind": registry.get(name, section="--evaluator").name} for name in names]


def record(run: LoadedRun, result: EvalResult, log: bool = True) -> list[Path]:
    """Append the scalars to metrics.jsonl, write the images as PNG and, with ``log``, log both
    to the run's [[log]] loggers (TensorBoard) at the checkpoint's step under the training's tags
    (``eval/<name>/<key>``), in new event files: nothing logged before is purged. Returns the
    image paths."""
    from torchvision.utils import save_image

    append_metrics(run.run_dir, run.step, result.scalars, checkpoint=run.checkpoint)
    paths = []
    for key, image in result.images.items():
        path = run.run_dir / "eval" / f"{key.removeprefix('eval/').replace('/', '-')}-step{run.step}.png"
        path.parent.mkdir(exist_ok=True)
        save_image(image.float().cpu(), path)
        paths.append(path)
    if log and (result.scalars or result.images):
        loggers = build_loggers(run.recipe, run.run_dir)
        try:
            for logger in loggers:
                if result.scalars:
                    logger.log_evaluation(run.step, result.scalars, run.checkpoint)
                if result.images:
                    logger.log_images(run.step, result.images)
        finally:
            for logger in loggers:
                logger.close()
    return paths


_record = record  # for LoadedRun.evaluate, whose argument ``record`` hides it


def pick_sampler(run: LoadedRun, name: str | None = None) -> tuple[Sampler, str]:
    """The sampler ``eblvm sample`` uses, and a label naming it and where its settings come from
    (``gibbs ([eval.1] sample-grid)``): the recipe's [sampler]; else the first [[eval]] that
    draws samples (a ``sampler`` and its ``sampler_options``, as sample-grid and fid have), so
    that samples look as in TensorBoard; else the sampler registered as the default for the model
    kind (``register(..., default_for=...)`` lists those kinds, e.g. ``gibbs`` for ``grbm``) with its
    defaults (``gibbs (defaults)``). ``name`` picks a sampler by name, with the recipe's settings
    for it where the recipe has some."""
    registry = load()["samplers"]
    sampler_section = run.recipe.parts.get("sampler")
    if sampler_section is not None and name in (None, sampler_section.kind):
        return run.parts.sampler, f"{sampler_section.kind} ([sampler])"
    for i, section in enumerate(run.recipe.evals):
        fields = attrs.asdict(section.config, recurse=False)  # an evaluator that samples has these two options
        chosen, options = fields.get("sampler"), fields.get("sampler_options")
        if isinstance(chosen, str) and isinstance(options, dict) and name in (None, chosen):
            sampler = _sampler(registry, chosen, options, f"eval.{i}", run)
            return sampler, f"{chosen} ([eval.{i}] {section.kind})"
    if name is None:
        model_kind = run.recipe.parts["model"].kind
        candidates = [e.name for e in registry.entries() if model_kind in e.default_for]
        if not candidates:
            raise EblvmError(
                f"no sampler for model '{model_kind}': add a [sampler] section to the recipe or pass --sampler "
                f"(registered: {', '.join(registry.names()) or 'none'})"
            )
        name = candidates[0]
    return _sampler(registry, name, {}, "--sampler", run), f"{name} (defaults)"


def _sampler(registry: Any, name: str, options: dict[str, Any], label: str, run: LoadedRun) -> Sampler:
    """Build sampler ``name`` with ``options``; errors name ``label`` and the run's recipe."""
    entry = registry.get(name, section=label)
    try:
        return _make(Section(label, entry, structure(entry.config, options, label)), run.parts)
    except ConfigError as exc:
        exc.file = exc.file or run.recipe.path
        raise


def samples_image(samples: Tensor, data: DataSplits | None, scale: int | None = None) -> Tensor:
    """Samples as one image (3, H, W) in [0, 1]: a scatter for 2-D vectors (axes, the data's
    bounds, every point shown: ``plot.scatter``), else a square-ish grid of images with every pixel
    repeated ``scale`` × ``scale`` times (None: each image at least ``plot.MIN_SIDE`` pixels on its
    shorter side; ``plot.image_grid``). Image shape: the data's ``image_shape``, its stored shape,
    or a square side; pixel values are mapped by the training data's range."""
    n = len(samples)
    flat = samples.reshape(n, -1).detach().float().cpu()
    if flat.shape[1] == 2:
        if data is None or data.bounds is None:
            return render(scatter(flat))
        x_bounds, y_bounds = data.bounds  # one (low, high) per dimension: two
        return render(scatter(flat, (x_bounds, y_bounds)))
    shape: tuple[int, ...] | None = data.image_shape if data is not None else None
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
    return image_grid(images, nrow=max(1, math.isqrt(n)), padding=2, scale=scale)


def sample_run(run: LoadedRun, n: int, sampler: str | None = None) -> tuple[Draw, Tensor, str]:
    """(the samples (n, *event_shape) with their diagnostics, their image, the sampler's name and
    where its settings come from) from the run's model."""
    chosen, source = pick_sampler(run, sampler)
    generator = torch.Generator(device=run.parts.device).manual_seed(run.seed)
    drawn = chosen.draw(run.parts.model, n, generator)
    return drawn, samples_image(drawn.samples, run.parts.data), source


def save_diagnostics(run: LoadedRun, drawn: Draw, source: str, path: Path) -> Path:
    """The diagnostics of the draw beside the image ``path``, as ``.json``: the run's step and
    checkpoint, the sampler and where its settings come from, the number of samples, the seed and
    ``diagnostics`` (name -> value; empty for a sampler that reports none); returns the file written."""
    target = path.with_suffix(".json")
    record = {
        "step": run.step,
        "checkpoint": run.checkpoint,
        "sampler": source,
        "n": len(drawn.samples),
        "seed": run.seed,
        "diagnostics": drawn.diagnostics,
    }
    target.write_text(json.dumps(record, indent=2) + "\n")
    return target


def save_samples(samples: Tensor, path: Path, raw: str) -> Path:
    """The raw samples (n, *event_shape) beside the image ``path``: ``.pt`` (a float tensor on the
    CPU, for torch.load) or ``.npy`` (for numpy.load); returns the file written."""
    values = samples.detach().cpu()
    if raw == "npy":
        import numpy as np

        target = path.with_suffix(".npy")
        np.save(target, values.numpy())
    else:
        target = path.with_suffix(".pt")
        torch.save(values, target)
    return target
