"""BiDVL's evaluations: test reconstruction through the encoder and the generator, OOD detection
by the marginal energy, and a sampler that draws G(z), z ~ N(0, I) (for sample grids and FID)."""

from __future__ import annotations

import math
from typing import Any, Literal, cast

import attrs
import torch
from torch import Tensor

from eblvm.plugin import (
    ConfigError,
    EnergyModel,
    EvalResult,
    NoConfig,
    Parts,
    Sampler,
    option,
    positive,
    reporting,
    structure,
)
from eblvm.tools import evaluation_mode, image_grid
from eblvm_bidvl.nets import posterior_codes


class GeneratorSampler(Sampler):
    """v = G(z), z ~ N(0, I): the variational joint's samples (n, *event_shape)."""

    def __init__(self, generator: torch.nn.Module):
        self.generator = generator

    def sample(self, model: EnergyModel, n: int, generator: torch.Generator | None = None) -> Tensor:
        param = next(self.generator.parameters())
        latent_dim = cast(int, self.generator.latent_dim)
        z = torch.randn(n, latent_dim, generator=generator, dtype=param.dtype, device=param.device)
        with torch.no_grad(), evaluation_mode([self.generator]):
            return self.generator(z)


def build_generator_sampler(cfg: NoConfig, parts: Parts) -> GeneratorSampler:
    """Samples G(z), z ~ N(0, I), of the recipe's [generator] (BiDVL's variational joint; batch norm in eval mode)."""
    return GeneratorSampler(parts.need("generator", "sampler"))


@attrs.frozen
class ReconstructionConfig:
    split: Literal["test", "train", "val"] = option("test", "the split reconstructed")
    n: int = option(10000, "examples reconstructed (the first n)", positive)
    batch_size: int = option(
        100, "examples per pass (the batch whose own statistics {split}_rmse_batch_stats normalises by)", positive
    )
    images: int = option(32, "originals and reconstructions shown side by side (0 for none)")


def build_reconstruction(cfg: ReconstructionConfig, parts: Parts):
    """Root-mean-square error of G(E_q[h|v]) against v per pixel, in the data's units, and an image of reconstructions.

    Read twice: {split}_rmse with batch norm's running statistics (eval mode, the model as deployed;
    the generator's of posterior codes where it keeps them apart from the prior draws'),
    {split}_rmse_batch_stats with each pass normalised by its own statistics (train mode, as the
    released BiDVL code's mse_score reads it, with its passes of 100); the running statistics are
    left as they were. Without batch norm the two are equal.
    """
    data = parts.need("data", "")
    parts.need("posterior", "")
    parts.need("generator", "")
    if not data.has(cfg.split):
        raise ConfigError("", "split", f"the data set has no '{cfg.split}' split")

    @reporting([f"{cfg.split}_rmse", f"{cfg.split}_rmse_batch_stats"])
    def evaluate(parts: Parts) -> EvalResult:
        n = min(cfg.n, parts.data.size(cfg.split))
        totals, shown = {False: 0.0, True: 0.0}, None
        modules = (parts.posterior, parts.generator)
        with torch.no_grad(), evaluation_mode(modules):  # modes and running statistics put back after
            for batch_stats in (False, True):  # running statistics first: train mode moves them
                for m in modules:
                    m.train(batch_stats)
                for start in range(0, n, cfg.batch_size):
                    v = parts.data.take(cfg.split, torch.arange(start, min(start + cfg.batch_size, n))).to(
                        parts.device, parts.dtype
                    )
                    with posterior_codes(parts.generator):
                        recon = parts.generator(parts.posterior.mean(v))
                    totals[batch_stats] += float((recon - v).square().sum())
                    if shown is None and cfg.images:
                        shown = (v[: cfg.images], recon[: cfg.images])
        scalars = {
            f"{cfg.split}_rmse{'_batch_stats' if batch_stats else ''}": math.sqrt(total / (n * parts.data.dim))
            for batch_stats, total in totals.items()
        }
        images = {}
        if shown is not None:
            low, high = parts.data.bounds[0] if parts.data.bounds else (0.0, 1.0)
            pairs = torch.stack(shown, 1).flatten(0, 1).float().cpu()  # original, reconstruction, original, ...
            images["reconstructions"] = image_grid(((pairs - low) / (high - low)).clamp(0, 1), nrow=16)
        return EvalResult(scalars=scalars, images=images)

    return evaluate


@attrs.frozen
class OODConfig:
    split: Literal["test", "train", "val"] = option("test", "the in-distribution split")
    n: int = option(10000, "examples per data set (the first n)", positive)
    uniform: bool = option(True, "compare with uniform noise over the data's box")
    against: list[dict[str, Any]] = option(
        [], 'other data sets, as [data] tables: [{ kind = "cifar10", root = "..." }]; their test splits'
    )
    batch_size: int = option(500, "examples per energy evaluation", positive)


def auroc(inliers: Tensor, outliers: Tensor) -> float:
    """Area under the ROC curve of a score that should be higher for inliers (ties count half)."""
    from sklearn.metrics import roc_auc_score

    labels = torch.cat([torch.ones(len(inliers)), torch.zeros(len(outliers))])
    return float(roc_auc_score(labels.numpy(), torch.cat([inliers, outliers]).double().numpy()))


def build_ood(cfg: OODConfig, parts: Parts):
    """OOD detection by −E_ψ(v) (or −F(v)): the AUROC of in-distribution images against uniform noise
    (uniform_auroc) and against each of the `against` data sets (<kind>_auroc).
    """
    data = parts.need("data", "")
    model = parts.need("model", "")
    if model.latent is not None and not model.has_free_energy:
        raise ConfigError(
            "",
            "kind",
            f"ood-auroc scores by the marginal energy: {type(model).__name__} has a latent and no free energy",
        )
    if not data.has(cfg.split):
        raise ConfigError("", "split", f"the data set has no '{cfg.split}' split")
    others = {}
    for i, body in enumerate(cfg.against):
        if not isinstance(body, dict) or "kind" not in body:
            raise ConfigError(
                "", f"against.{i}", 'must be a table with a data set kind, e.g. { kind = "cifar10", root = "..." }'
            )
        entry = parts.registry("datasets").get(body["kind"], section="")
        other = entry.factory(
            structure(entry.config, {k: v for k, v in body.items() if k != "kind"}, f"against.{i}"), parts
        )
        if other.shape != data.shape or (other.bounds or [None])[0] != (data.bounds or [None])[0]:
            raise ConfigError(
                "",
                f"against.{i}",
                f"data set '{body['kind']}' has examples {other.shape} in {(other.bounds or ['?'])[0]}, "
                f"this one {data.shape} in {(data.bounds or ['?'])[0]}: resize and scale them alike",
            )
        others[body["kind"]] = other
    keys = (["uniform_auroc"] if cfg.uniform else []) + [f"{name}_auroc" for name in others]

    def scores(parts: Parts, n: int, take) -> Tensor:
        """−E_ψ (n,) of the examples take(start, stop), batch by batch."""
        out = []
        with torch.no_grad():
            for start in range(0, n, cfg.batch_size):
                v = take(start, min(start + cfg.batch_size, n))
                v = v.to(parts.device, parts.dtype)
                model = parts.model
                energy = model.free_energy(v) if model.has_free_energy else model.energy(v, v.new_zeros(len(v), 0))
                out.append(-energy.float().cpu())
        return torch.cat(out)

    @reporting(keys)
    def evaluate(parts: Parts) -> EvalResult:
        n = min(cfg.n, parts.data.size(cfg.split))
        inliers = scores(parts, n, lambda a, b: parts.data.take(cfg.split, torch.arange(a, b)))
        results = {}
        if cfg.uniform:
            low, high = parts.data.bounds[0] if parts.data.bounds else (0.0, 1.0)
            g = torch.Generator().manual_seed(0)
            noise = low + (high - low) * torch.rand(n, *parts.data.shape, generator=g)
            results["uniform_auroc"] = auroc(inliers, scores(parts, n, lambda a, b: noise[a:b]))
        for name, other in others.items():
            m = min(cfg.n, other.size("test"))
            results[f"{name}_auroc"] = auroc(
                inliers, scores(parts, m, lambda a, b, o=other: o.take("test", torch.arange(a, b)))
            )
        return EvalResult(scalars=results)

    return evaluate
