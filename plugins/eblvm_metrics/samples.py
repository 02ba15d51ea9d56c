"""The sample grid: model samples drawn by a registered sampler, shown as one image."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

from eblvm_core.config import non_negative, option, positive, structure
from eblvm_core.contracts import EvalResult, Parts, reporting
from eblvm_core.errors import ConfigError
from eblvm_core.plot import image_grid
from eblvm_core.plugins import registry


@attrs.frozen
class SampleGridConfig:
    sampler: str = option("gibbs", "registered sampler that draws the samples (listed by `eblvm plugins`)")
    sampler_options: dict[str, Any] = option(
        {}, "that sampler's options, e.g. { burn_in = 200 }; the others keep their defaults"
    )
    n: int = option(64, "number of samples in the grid", positive)
    nrow: int = option(8, "images per row of the grid", positive)
    padding: int = option(2, "white pixels between images (before upscaling)", non_negative)
    scale: int = option(
        0,
        "every pixel drawn as scale × scale pixels (nearest neighbour); 0: the smallest whole factor that makes "
        "each image at least 64 pixels on its shorter side",
        non_negative,
    )
    seed: int = option(0, "seed of the sampler's generator: every evaluation starts from the same noise")


def build_sample_grid(cfg: SampleGridConfig, parts: Parts) -> Callable[[Parts], EvalResult]:
    """Model samples from a registered sampler (default: Gibbs), clamped to [0, 1] and tiled as an image grid,
    upscaled to a readable size."""
    parts.need("model", "")
    data = parts.need("data", "")
    shape = data.image_shape
    if shape is None:
        raise ConfigError("", "kind", f"sample-grid draws images; this dataset (d={data.dim}) has no image shape")
    samplers = registry("samplers")
    if cfg.sampler not in samplers:
        raise ConfigError(
            "", "sampler", f"unknown sampler '{cfg.sampler}'; valid: {', '.join(samplers.names()) or 'none registered'}"
        )
    entry = samplers.get(cfg.sampler)
    try:
        sampler_cfg = structure(entry.config, cfg.sampler_options, "")
    except ConfigError as exc:
        key = f"sampler_options.{exc.key}" if exc.key else "sampler_options"
        raise ConfigError("", key, f"sampler '{cfg.sampler}': {exc.message}") from None
    try:
        sampler = entry.factory(sampler_cfg, parts)
    except ConfigError as exc:
        raise ConfigError("", "sampler", exc.message) from None

    low, high = data.bounds[0] if data.bounds else (0.0, 1.0)

    @reporting([])
    def evaluate(parts: Parts) -> EvalResult:
        """{"samples": (3, H', W')}: n images of shape (C, H, W) tiled nrow to a row, in [0, 1], every
        pixel repeated scale × scale times (``plot.image_grid``); with a sampler that keeps a
        trajectory (annealed Langevin's ``snapshots``) also {"trajectory"}: one row per chain (up to
        nrow chains), its states left to right."""
        generator = torch.Generator(device=parts.device).manual_seed(cfg.seed)
        samples = sampler.sample(parts.model, cfg.n, generator).detach()  # (n, *event_shape)

        def unit(x: torch.Tensor) -> torch.Tensor:
            return ((x.float().cpu() - low) / (high - low)).clamp(0, 1)

        scale = cfg.scale or None
        images = {"samples": image_grid(unit(samples.reshape(cfg.n, *shape)), cfg.nrow, cfg.padding, scale)}
        trajectory = getattr(sampler, "trajectory", None)
        if trajectory is not None:
            k = trajectory.shape[0]
            chains = trajectory[:, : cfg.nrow].transpose(0, 1).reshape(-1, *shape)  # chain-major, states in order
            images["trajectory"] = image_grid(unit(chains), k, cfg.padding, scale)
        return EvalResult(images=images)

    options = ", ".join(f"{k} = {v}" for k, v in cfg.sampler_options.items())
    evaluate.announce = f"{cfg.n} samples by {cfg.sampler}" + (f" ({options})" if options else "") + "…"
    return evaluate
