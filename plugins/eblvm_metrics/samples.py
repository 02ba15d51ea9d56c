"""The sample grid: model samples drawn by a registered sampler, shown as one image."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

from eblvm.plugin import ConfigError, EvalResult, Parts, Sampler, non_negative, option, positive, reporting, structure
from eblvm.tools import image_grid


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


def named_sampler(name: str, options: dict[str, Any], parts: Parts) -> Sampler:
    """The registered sampler ``name`` built with ``options`` (the others at their defaults); its
    errors name this evaluator's ``sampler`` / ``sampler_options`` keys."""
    samplers = parts.registry("samplers")
    if name not in samplers:
        raise ConfigError(
            "", "sampler", f"unknown sampler '{name}'; valid: {', '.join(samplers.names()) or 'none registered'}"
        )
    entry = samplers.get(name)
    try:
        sampler_cfg = structure(entry.config, options, "")
    except ConfigError as exc:
        key = f"sampler_options.{exc.key}" if exc.key else "sampler_options"
        raise ConfigError("", key, f"sampler '{name}': {exc.message}") from None
    try:
        return entry.factory(sampler_cfg, parts)
    except ConfigError as exc:
        raise ConfigError("", "sampler", exc.message) from None


def build_sample_grid(cfg: SampleGridConfig, parts: Parts) -> Callable[[Parts], EvalResult]:
    """Model samples from a registered sampler (default: Gibbs), clamped to [0, 1] and tiled as an image grid,
    upscaled to a readable size; the sampler's diagnostics (acceptance, ESS, R-hat) as scalars."""
    parts.need("model", "")
    data = parts.need("data", "")
    shape = data.image_shape
    if shape is None:
        raise ConfigError("", "kind", f"sample-grid draws images; this dataset (d={data.dim}) has no image shape")
    sampler = named_sampler(cfg.sampler, cfg.sampler_options, parts)

    low, high = data.bounds[0] if data.bounds else (0.0, 1.0)

    @reporting(sampler.diagnostics_keys(parts.model, cfg.n))
    def evaluate(parts: Parts) -> EvalResult:
        """{"samples": (3, H', W')}: n images of shape (C, H, W) tiled nrow to a row, in [0, 1], every
        pixel repeated scale × scale times (``plot.image_grid``); with a sampler that keeps a
        trajectory (annealed Langevin's ``snapshots``) also {"trajectory"}: one row per chain (up to
        nrow chains), its states left to right. The sampler's diagnostics (acceptance, ESS, split
        R-hat...) are its scalars."""
        generator = torch.Generator(device=parts.device).manual_seed(cfg.seed)
        drawn = sampler.draw(parts.model, cfg.n, generator)
        samples = drawn.samples.detach()  # (n, *event_shape)

        def unit(x: torch.Tensor) -> torch.Tensor:
            return ((x.float().cpu() - low) / (high - low)).clamp(0, 1)

        scale = cfg.scale or None
        images = {"samples": image_grid(unit(samples.reshape(cfg.n, *shape)), cfg.nrow, cfg.padding, scale)}
        trajectory = getattr(sampler, "trajectory", None)
        if trajectory is not None:
            k = trajectory.shape[0]
            chains = trajectory[:, : cfg.nrow].transpose(0, 1).reshape(-1, *shape)  # chain-major, states in order
            images["trajectory"] = image_grid(unit(chains), k, cfg.padding, scale)
        return EvalResult(scalars=drawn.diagnostics, images=images)

    options = ", ".join(f"{k} = {v}" for k, v in cfg.sampler_options.items())
    evaluate.announce = f"{cfg.n} samples by {cfg.sampler}" + (f" ({options})" if options else "") + "…"
    return evaluate


@attrs.frozen
class SampleClassesConfig:
    sampler: str = option("annealed-langevin", "registered sampler that draws the samples (listed by `eblvm plugins`)")
    sampler_options: dict[str, Any] = option(
        {}, "that sampler's options, e.g. { anneal_steps = 600 }; the others keep their defaults"
    )
    n: int = option(64, "samples labelled, and test images and noise images beside them", positive)
    n_train: int = option(10000, "training examples the classifier is fitted on (the first n)", positive)
    seed: int = option(0, "seed of the sampler's generator and of the noise images")


def label_statistics(probabilities: torch.Tensor) -> tuple[float, float]:
    """(mean top-class probability, entropy in nats of the histogram of predicted labels) of class
    probabilities (n, k): confident and varied labels give both high (at most 1 and log k)."""
    counts = torch.bincount(probabilities.argmax(1), minlength=probabilities.shape[1]).double()
    share = counts / counts.sum()
    entropy = -(share[share > 0] * share[share > 0].log()).sum()
    return float(probabilities.max(1).values.mean()), float(entropy)


def build_sample_classes(cfg: SampleClassesConfig, parts: Parts) -> Callable[[Parts], EvalResult]:
    """Do the samples look like the data's classes? A logistic-regression classifier fitted on the
    labelled training images labels n model samples, n test images and n uniform-noise images in the
    data's range; for each it reports the mean top-class probability (confidence) and the entropy of
    the histogram of labels (variety; log 10 = 2.30 for ten equally frequent digits), and the
    classifier's test accuracy. No Inception network: for small images such as the 8×8 digits.
    """
    parts.need("model", "")
    data = parts.need("data", "")
    for split in ("train", "test"):
        if not data.has(split) or not data.labels or split not in data.labels:
            raise ConfigError(
                "", "kind", f"sample-classes fits a classifier on labels: the data set has none for '{split}'"
            )
    sampler = named_sampler(cfg.sampler, cfg.sampler_options, parts)
    low, high = data.bounds[0] if data.bounds else (0.0, 1.0)
    keys = ["samples", "test", "noise"]

    @reporting([f"{k}_{s}" for k in keys for s in ("confidence", "label_entropy")] + ["classifier_accuracy"])
    def evaluate(parts: Parts) -> EvalResult:
        from sklearn.linear_model import LogisticRegression

        n_train = min(cfg.n_train, data.size("train"))
        x_train = data.take("train", torch.arange(n_train)).flatten(1).double().cpu()
        classifier = LogisticRegression(max_iter=5000).fit(x_train.numpy(), data.labels["train"][:n_train].numpy())
        generator = torch.Generator(device=parts.device).manual_seed(cfg.seed)
        samples = sampler.sample(parts.model, cfg.n, generator).detach().flatten(1).double().cpu()
        n_test = min(cfg.n, data.size("test"))
        test = data.take("test", torch.arange(n_test)).flatten(1).double().cpu()
        noise = low + (high - low) * torch.rand(cfg.n, data.dim, generator=torch.Generator().manual_seed(cfg.seed))
        scalars = {}
        for key, x in zip(keys, (samples.clamp(low, high), test, noise.double())):
            confidence, entropy = label_statistics(torch.from_numpy(classifier.predict_proba(x.numpy())))
            scalars[f"{key}_confidence"], scalars[f"{key}_label_entropy"] = confidence, entropy
        n_all = data.size("test")
        x_all = data.take("test", torch.arange(n_all)).flatten(1).double().cpu()
        scalars["classifier_accuracy"] = float(classifier.score(x_all.numpy(), data.labels["test"][:n_all].numpy()))
        return EvalResult(scalars=scalars)

    evaluate.announce = f"{cfg.n} samples by {cfg.sampler} labelled by a classifier of the training data…"
    return evaluate
