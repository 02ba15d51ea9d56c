"""A test plugin for the distributed tests: the bundled Bernoulli posterior and SSM objective with
their random draws made a function of each data point (and of the call count) instead of a
process's random stream, so that W processes holding shards of a batch draw exactly what one
process holding the whole batch draws; an evaluator that reports every parameter; an
exact-score estimator whose loss turns NaN on rank 1 at one step; and one that rank 0 builds
slowly, saying so in a file, so that a signal can reach the ranks while they set up.

Loaded with ``EBLVM_PLUGIN_MODULES=tests.support.fixed_noise`` (the repository root on the path).
"""

from __future__ import annotations

import time
import zlib
from pathlib import Path

import attrs
import torch
import torch.distributed as dist
from eblvm_posteriors import BernoulliConfig, BernoulliPosterior, latent_dim, relaxed_bernoulli
from eblvm_score.estimators import ExactScore, build_exact_score
from eblvm_score.objectives import SSM, SSMConfig
from torch import Tensor

from eblvm_core.config import option, positive
from eblvm_core.contracts import EvalResult, Parts
from eblvm_core.hookspecs import hookimpl
from eblvm_core.registry import NoConfig


class PointNoise:
    """Uniform draws u (n, B, k) in [0, 1): row b is a function of v[b]'s bytes and of the number
    of calls so far only, whichever rows share the batch."""

    def __init__(self):
        self.calls = 0

    def __call__(self, v: Tensor, n: int, k: int) -> Tensor:
        self.calls += 1
        tag = self.calls.to_bytes(8, "little")
        rows = v.detach().to("cpu", torch.float64).flatten(1).numpy()
        draws = [
            torch.rand(
                n, k, dtype=torch.float64, generator=torch.Generator().manual_seed(zlib.crc32(row.tobytes() + tag))
            )
            for row in rows
        ]
        return torch.stack(draws, 1).to(v)


class PointNoiseBernoulli(BernoulliPosterior):
    """The bundled Bernoulli posterior; the binary-concrete noise of ``rsample`` comes from ``PointNoise``."""

    def __init__(self, *args):
        super().__init__(*args)
        self.noise = PointNoise()

    def rsample(self, v: Tensor, n: int = 1) -> Tensor:
        return self.rsample_and_log_prob(v, n)[0]

    def rsample_and_log_prob(self, v: Tensor, n: int = 1) -> tuple[Tensor, Tensor]:
        logits = self.logits(v)
        h = relaxed_bernoulli(logits, self.noise(v, n, logits.shape[-1]), self.temperature)
        return h, self._log_prob(h, logits)


def build_point_noise_bernoulli(cfg: BernoulliConfig, parts: Parts) -> PointNoiseBernoulli:
    """Bernoulli q(h|v) whose relaxation noise is a function of the data point."""
    m = latent_dim(parts, "bernoulli")
    return PointNoiseBernoulli(parts.need("data", "posterior").dim, m, cfg.hidden, cfg.activation, cfg.temperature)


class PointNoiseSSM(SSM):
    """The bundled SSM; the Rademacher slices come from ``PointNoise`` at the points x."""

    def __init__(self, n_slices: int):
        super().__init__(n_slices, "rademacher")
        self.noise = PointNoise()

    def loss(self, score, x: Tensor, context: None) -> Tensor:
        self.at = x  # where the next slices are drawn
        return super().loss(score, x, context)

    def slices(self, like: Tensor) -> Tensor:
        u = self.noise(self.at, self.n_slices, like[0].numel())
        return torch.where(u < 0.5, -1.0, 1.0).to(like).view(self.n_slices, *like.shape)


def build_point_noise_ssm(cfg: SSMConfig, parts: Parts) -> PointNoiseSSM:
    """Sliced score matching whose Rademacher slices are a function of the data point."""
    return PointNoiseSSM(cfg.n_slices)


def build_parameters(cfg: NoConfig, parts: Parts):
    """Every entry of every network's parameters as a scalar ``<network>.<name>.<index>``."""

    def evaluate(parts: Parts) -> EvalResult:
        return EvalResult(
            scalars={
                f"{section}.{name}.{i}": value
                for section, net in parts.networks().items()
                for name, p in net.named_parameters()
                for i, value in enumerate(p.detach().flatten().tolist())
            }
        )

    return evaluate


@attrs.frozen
class NaNConfig:
    at_step: int = option(3, "the step (1-based) whose loss is NaN on rank 1", positive)


class NaNOnRank1(ExactScore):
    """Exact-score training whose reported loss is NaN on rank 1 at one step (a float, as BiSM reports)."""

    def __init__(self, base: ExactScore, at_step: int):
        self.__dict__.update(base.__dict__)
        self.at_step, self.steps = at_step, 0

    def step(self, batch: Tensor) -> dict[str, float]:
        metrics = super().step(batch)
        self.steps += 1
        if dist.get_rank() == 1 and self.steps == self.at_step:
            metrics["loss"] = float("nan")
        return metrics


def build_nan_on_rank1(cfg: NaNConfig, parts: Parts) -> NaNOnRank1:
    """Exact score whose loss is NaN on rank 1 at one step."""
    return NaNOnRank1(build_exact_score(NoConfig(), parts), cfg.at_step)


@attrs.frozen
class SlowBuildConfig:
    marker: str = option(help="the file rank 0 writes as it starts building")
    seconds: float = option(1.0, "how long rank 0 then builds", positive)


def build_slow_on_rank0(cfg: SlowBuildConfig, parts: Parts) -> ExactScore:
    """Exact score; rank 0 writes ``marker`` and waits ``seconds`` before building it (rank 1 is by
    then waiting for rank 0 at the set-up's next collective)."""
    if dist.get_rank() == 0:
        Path(cfg.marker).write_text("building")
        time.sleep(cfg.seconds)
    return build_exact_score(NoConfig(), parts)


@hookimpl
def register_posteriors(register):
    register("bernoulli-point-noise", build_point_noise_bernoulli, BernoulliConfig)


@hookimpl
def register_objectives(register):
    register("ssm-point-noise", build_point_noise_ssm, SSMConfig)


@hookimpl
def register_estimators(register):
    register("exact-score-nan-on-rank1", build_nan_on_rank1, NaNConfig)
    register("exact-score-slow-build-on-rank0", build_slow_on_rank0, SlowBuildConfig)


@hookimpl
def register_evaluators(register):
    register("parameters", build_parameters, NoConfig)
