"""Block Gibbs sampling for the GRBM (v → h → v): p(h_j = 1 | v) = sigmoid(c_j + (Uᵀv)_j) and
p(v | h) = N(b + σ²Uh, σ²I), U the model's coupling weight (W/σ or W). AIS runs its own sweeps
along its annealing path (ais.py).
"""

from __future__ import annotations

from typing import Literal

import attrs
import torch
from torch import Tensor

from eblvm.plugin import ConfigError, DataSplits, Draw, EnergyModel, Parts, Sampler, non_negative, option, positive
from eblvm.tools import chain_diagnostics, chain_diagnostics_keys
from eblvm_grbm.model import GRBM


def sample_hidden(model: GRBM, v: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """h ~ p(h | v): v (B, d) -> h (B, m) in {0, 1}."""
    return torch.bernoulli(torch.sigmoid(model.hidden_logits(v)), generator=generator)


def sample_visible(model: GRBM, h: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """v ~ p(v | h) = N(b + σ²Uh, σ²I): h (B, m) -> v (B, d)."""
    mean = model.visible_mean(h)
    noise = torch.randn(mean.shape, generator=generator, dtype=mean.dtype, device=mean.device)
    return mean + model.sigma * noise


def gibbs_sweep(model: GRBM, v: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One sweep v → h → v; leaves p(v) invariant. v (B, d) -> (B, d)."""
    return sample_visible(model, sample_hidden(model, v, generator), generator)


def gibbs_chain(model: GRBM, v: Tensor, n_steps: int, generator: torch.Generator | None = None) -> Tensor:
    """``n_steps`` sweeps from v (B, d) at β = 1, without gradients; returns the last state (B, d)."""
    with torch.no_grad():
        for _ in range(n_steps):
            v = gibbs_sweep(model, v, generator)
    return v


def require_grbm(model: EnergyModel | None, section: str, what: str) -> GRBM:
    """The model, if it is a GRBM; else a ConfigError naming ``section``."""
    if not isinstance(model, GRBM):
        raise ConfigError(
            section, "kind", f"{what} needs a GRBM model (block Gibbs sampling), got {type(model).__name__}"
        )
    return model


def initial_states(
    init: str, n: int, data: DataSplits | None, like: Tensor, generator: torch.Generator | None = None
) -> Tensor:
    """n starting points (n, d): random training points (``data``) or Gaussian noise with the
    training data's per-dimension mean and std (``noise``; N(0, I) when there is no data)."""
    d = like.shape[0]
    if init == "data":
        if data is None:
            raise ValueError("initial states from the data ('data') need the data splits")
        idx = torch.randint(data.size("train"), (n,), generator=generator, device=like.device)
        return data.tensor("train").reshape(data.size("train"), -1)[idx].to(like)
    noise = torch.randn(n, d, generator=generator, dtype=like.dtype, device=like.device)
    if data is None:
        return noise
    train = data.tensor("train").reshape(data.size("train"), -1).to(like)
    return train.mean(0) + train.std(0) * noise


@attrs.frozen
class GibbsConfig:
    burn_in: int = option(1000, "sweeps v→h→v before the first kept state (the papers ran 1,000)", non_negative)
    n_steps: int = option(1, "sweeps between successive kept states of one chain (thinning)", positive)
    n_chains: int = option(0, "parallel chains; 0 runs one chain per requested sample", non_negative)
    init: Literal["noise", "data"] = option(
        "noise", "start from Gaussian noise matched to the data, or from training points"
    )
    final_mean: bool = option(
        False, "return the mean of p(v|h) at the last half-sweep instead of a draw (denoised images)"
    )


class GibbsSampler(Sampler):
    """Block Gibbs sampling of a GRBM: chains run ``burn_in`` sweeps, then each yields a state
    every ``n_steps`` sweeps until n samples are collected."""

    def __init__(self, cfg: GibbsConfig, data: DataSplits | None):
        self.cfg, self.data = cfg, data

    def chains(self, n: int) -> tuple[int, int]:
        """(parallel chains, states kept per chain) for n samples."""
        chains = n if self.cfg.n_chains == 0 else min(self.cfg.n_chains, n)
        return chains, -(-n // chains)

    def sample(self, model: EnergyModel, n: int, generator: torch.Generator | None = None) -> Tensor:
        """n samples (n, *event_shape) of v from the GRBM's marginal p(v) ((n, d) without data)."""
        return self.draw(model, n, generator).samples

    def draw(self, model: EnergyModel, n: int, generator: torch.Generator | None = None) -> Draw:
        """n samples as ``sample`` draws them, with the ESS and split R-hat of the free energy and of
        projections of the kept states over the chains (when each chain keeps at least 4)."""
        grbm = require_grbm(model, "sampler", "the gibbs sampler")
        cfg = self.cfg
        chains, per_chain = self.chains(n)
        with torch.no_grad():
            v = initial_states(cfg.init, chains, self.data, grbm.b, generator)
            v = gibbs_chain(grbm, v, cfg.burn_in, generator)
            states, kept = [], []
            for i in range(per_chain):
                if i > 0:
                    v = gibbs_chain(grbm, v, cfg.n_steps, generator)
                states.append(v)
                if cfg.final_mean:
                    kept.append(grbm.visible_mean(sample_hidden(grbm, v, generator)))
                else:
                    kept.append(v)
            trace = torch.stack(states)  # (per_chain, chains, d)
            diagnostics = chain_diagnostics(grbm.free_energy(trace.flatten(0, 1)).view(per_chain, chains), trace)
        samples = torch.cat(kept)[:n]
        return Draw(samples if self.data is None else samples.reshape(n, *self.data.shape), diagnostics)

    def diagnostics_keys(self, model: EnergyModel, n: int) -> tuple[str, ...]:
        return chain_diagnostics_keys(self.chains(n)[1])


def build_gibbs(cfg: GibbsConfig, parts: Parts) -> GibbsSampler:
    """Block Gibbs sampler v → h → v for GRBMs."""
    if parts.model is not None:
        require_grbm(parts.model, "sampler", "the gibbs sampler")
    return GibbsSampler(cfg, parts.data)
