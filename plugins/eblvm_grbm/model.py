"""The Gaussian restricted Boltzmann machine (BiSM Sec. 5.1)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal, cast

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eblvm.plugin import EnergyModel, LatentSpec, Parts, option, positive

# Exact log Z costs ~100 ns per hidden state on two CPU cores at d = 2 (~600 ns at d = 560):
# 2^40 ≈ 1.1e12 states is one to eight days there, the most the enumeration may be asked for.
MAX_ENUMERATED_HIDDEN = 40
# States per chunk × (d + m) stays under this: with the int64 bit arithmetic, ~20 bytes per
# element, a working set of tens of MB whatever m is.
CHUNK_ELEMENTS = 2**20


@attrs.frozen
class GRBMConfig:
    n_hidden: int = option(4, "number of Bernoulli hidden units m", positive)
    init_sigma: float = option(1.0, "initial σ (log σ is learned)", positive)
    init_weight_std: float = option(0.1, "standard deviation of the initial W entries", positive)
    learn_sigma: bool = option(True, "learn log σ (else it stays at init_sigma)")
    coupling: Literal["scaled", "plain"] = option(
        "plain",
        "'plain': −vᵀWh, the papers' released code and every bundled recipe (so docs/results.md's numbers are "
        "this model's); 'scaled': −vᵀWh/σ, the BiSM paper's formula (σ then enters the posterior: BiSSM with five "
        "plain unrolled steps does not train under it, the Gauss-Newton unroll does; docs/results.md)",
    )


class GRBM(EnergyModel):
    """E(v, h) = ‖v − b‖²/(2σ²) − cᵀh − vᵀUh, v ∈ R^d, h ∈ {0,1}^m, with the coupling U = W/σ
    (``coupling="scaled"``, the paper's formula) or U = W (``"plain"``, the released code's).

    Parameters: W (d, m), b (d,), c (m,), log_sigma (scalar). Then p(h_j = 1 | v) =
    sigmoid(c_j + (Uᵀv)_j) and p(v | h) = N(b + σ²Uh, σ²I): b + σWh when scaled. v may come
    shaped as images (B, C, H, W); the model sees it flattened to (B, d).
    """

    def __init__(
        self,
        n_visible: int,
        n_hidden: int,
        init_sigma: float = 1.0,
        init_weight_std: float = 0.1,
        learn_sigma: bool = True,
        coupling: str = "scaled",
    ):
        super().__init__()
        if coupling not in ("scaled", "plain"):
            raise ValueError(f"coupling must be 'scaled' or 'plain', got {coupling!r}")
        self.latent = LatentSpec("bernoulli", n_hidden)
        self.coupling = coupling
        self.W = nn.Parameter(torch.randn(n_visible, n_hidden) * init_weight_std)
        self.b = nn.Parameter(torch.zeros(n_visible))
        self.c = nn.Parameter(torch.zeros(n_hidden))
        self.log_sigma = nn.Parameter(torch.tensor(math.log(init_sigma)), requires_grad=learn_sigma)

    @property
    def sigma(self) -> Tensor:
        return self.log_sigma.exp()

    # The hot methods below read the parameters from ``_parameters`` (a dict look-up) rather than as
    # attributes (nn.Module.__getattr__, a Python call each) and skip flatten(1) when v is (B, d)
    # already (where it returns v itself): an unrolled BiSM step evaluates the energy a dozen times
    # on a tiny model, where such calls cost more than the arithmetic. Image-shaped v is still
    # flattened in each method, so its gradient is accumulated as before, to the bit. Every entry of
    # a GRBM's ``_parameters`` is set (none is None): ``cast`` says so to the type checker alone.

    def coupling_weight(self) -> Tensor:
        """U (d, m): W/σ when scaled, W when plain."""
        p = cast("dict[str, Tensor]", self._parameters)
        return p["W"] * torch.exp(-p["log_sigma"]) if self.coupling == "scaled" else p["W"]

    def visible_quadratic(self, v: Tensor) -> Tensor:
        """‖v − b‖²/(2σ²): v (B, ...) -> (B,)."""
        p = cast("dict[str, Tensor]", self._parameters)
        v = v if v.dim() == 2 else v.flatten(1)
        return 0.5 * ((v - p["b"]) ** 2).sum(-1) * torch.exp(-2 * p["log_sigma"])

    def energy(self, v: Tensor, h: Tensor) -> Tensor:
        """v (B, ...), h (B, m) -> (B,)."""
        return self.visible_quadratic(v) - (h * self.hidden_logits(v)).sum(-1)

    def hidden_logits(self, v: Tensor) -> Tensor:
        """Logits c + Uᵀv of p(h_j = 1 | v): v (B, ...) -> (B, m)."""
        v = v if v.dim() == 2 else v.flatten(1)
        return cast("dict[str, Tensor]", self._parameters)["c"] + v @ self.coupling_weight()

    def free_energy(self, v: Tensor) -> Tensor:
        """F(v) = ‖v − b‖²/(2σ²) − Σ_j softplus(c_j + (Uᵀv)_j): v (B, ...) -> (B,)."""
        return self.visible_quadratic(v) - F.softplus(self.hidden_logits(v)).sum(-1)

    def visible_mean(self, h: Tensor) -> Tensor:
        """Mean b + σ²Uh of p(v | h): h (B, m) -> (B, d)."""
        return self.b + self.sigma**2 * h @ self.coupling_weight().T

    def gibbs_sweep(self, v: Tensor, beta: Tensor, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """One sweep of p_β(v, h) ∝ exp(−β E(v, h)) at β (B,): h_j ~ Bernoulli(sigmoid(β(c + Uᵀv)_j)),
        then v' ~ N(b + σ²Uh, σ²/β I); v (B, ...) -> (v' shaped like v, h (B, m))."""
        with torch.no_grad():
            h = torch.bernoulli(torch.sigmoid(beta[:, None] * self.hidden_logits(v)), generator=generator)
            mean = self.visible_mean(h)
            noise = torch.randn(mean.shape, generator=generator, dtype=mean.dtype, device=mean.device)
            return (mean + self.sigma * noise / beta[:, None].sqrt()).view(v.shape), h

    def log_partition(
        self, max_hidden: int = 20, chunk: int | None = None, progress: Callable[[int, int], None] | None = None
    ) -> Tensor:
        """log Z (scalar) by enumerating the 2^m hidden states (v integrated in closed form).

        Z = Σ_h exp(cᵀh + bᵀUh + ½σ²‖Uh‖²) (2πσ²)^{d/2}. The states come ``chunk`` at a time
        (default ``default_chunk(d, m)``), each chunk's log-sum-exp folded into a float64 running
        log-add-exp, so without autograd the working set is O(chunk · (d + m)) whatever m is; under
        autograd the graph keeps every chunk. ``progress(done, 2^m)`` is called after each chunk.
        Refuses m > max_hidden and m > MAX_ENUMERATED_HIDDEN.
        """
        d, m = self.W.shape
        limit = min(max_hidden, MAX_ENUMERATED_HIDDEN)
        if m > limit:
            raise ValueError(f"exact log Z enumerates 2^{m} hidden states; m={m} exceeds the limit {limit}")
        n, chunk = 2**m, default_chunk(d, m) if chunk is None else chunk
        u = self.coupling_weight()
        log_z: Tensor | None = None
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            hs = binary_states(start, stop, m, u)  # (stop − start, m)
            uh = hs @ u.T  # (stop − start, d)
            terms = hs @ self.c + uh @ self.b + 0.5 * self.sigma**2 * (uh**2).sum(-1)
            part = torch.logsumexp(terms, 0).double()
            log_z = part if log_z is None else torch.logaddexp(log_z, part)
            if progress is not None:
                progress(stop, n)
        if log_z is None:  # no chunk: ``chunk`` was not positive
            raise ValueError(f"log_partition: chunk must be positive, got {chunk}")
        return log_z.to(u.dtype) + 0.5 * d * torch.log(2 * math.pi * self.sigma**2)

    def log_likelihood(self, v: Tensor, max_hidden: int = 20) -> Tensor:
        """Exact log p(v) = −F(v) − log Z: v (B, ...) -> (B,)."""
        return -self.free_energy(v) - self.log_partition(max_hidden)


def default_chunk(d: int, m: int) -> int:
    """States per chunk of the enumeration: the largest power of two with chunk · (d + m) ≤ CHUNK_ELEMENTS."""
    return 1 << max(0, (CHUNK_ELEMENTS // (d + m)).bit_length() - 1)


def binary_states(start: int, stop: int, m: int, like: Tensor) -> Tensor:
    """States number start, …, stop − 1 of the 2^m binary vectors in ``itertools.product`` order
    (h_j is bit m − 1 − j of the number): (stop − start, m) in {0, 1}, dtype and device of ``like``."""
    index = torch.arange(start, stop, device=like.device)[:, None]  # int64: exact for m ≤ 62
    return ((index >> torch.arange(m - 1, -1, -1, device=like.device)) & 1).to(like.dtype)


def all_binary(m: int, like: Tensor) -> Tensor:
    """All 2^m binary vectors (2^m, m), dtype and device of ``like``: for small m (tests, plots)."""
    return binary_states(0, 2**m, m, like)


def build_grbm(cfg: GRBMConfig, parts: Parts) -> GRBM:
    """Gaussian RBM with Bernoulli hidden units, a learned σ and the scaled (W/σ) or plain (W) coupling."""
    data = parts.need("data", "model")
    return GRBM(data.dim, cfg.n_hidden, cfg.init_sigma, cfg.init_weight_std, cfg.learn_sigma, cfg.coupling)
