"""Models whose every quantity is known exactly, for tests: the linear-Gaussian EBLVM (Gaussian
posterior and marginal in closed form) and a tiny GRBM with its exact Bernoulli posterior, each with
a variational posterior set to the exact one (``Exact``); and ``make``, which builds a registered
component with its options validated as in a recipe."""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from eblvm_core.contracts import DataSplits, EnergyModel, LatentSpec, Parts, Posterior

F64 = torch.float64


def make(kind: str, name: str, parts: Any = None, **options: Any) -> Any:
    """Build the registered component ``name`` of ``kind`` (a registry name: "divergences", ...).

    ``options`` are checked against its config class exactly like a recipe section (unknown
    keys, types, validators) and the factory is called as ``factory(config, parts)``; for
    optimizers and loggers pass the params or the run directory as ``parts``.
    """
    from eblvm_core.config import structure
    from eblvm_core.plugins import load

    entry = load()[kind].get(name)
    config = structure(entry.config, options, kind[:-1])
    return entry.factory(config, Parts() if parts is None else parts)


# ---- models with an exact posterior ----------------------------------------------------------


class LinearGaussianEBLVM(EnergyModel):
    """A linear-Gaussian EBLVM for exact checks: Gaussian v and h, bilinear coupling.

    E(v, h) = ½λ‖v − b‖² + ½hᵀDh − vᵀWh − cᵀh with λ = exp(log_lam), D = diag(exp(log_d));
    v (B, d) or any (B, ...) that flattens to d.
    Its posterior is p(h|v) = N(D⁻¹(Wᵀv + c), D⁻¹) and its free energy is Gaussian in v, so the
    exact marginal score (and every score-matching gradient) is available by autograd.
    """

    def __init__(self, d: int, m: int, generator: torch.Generator | None = None, dtype: torch.dtype = F64):
        super().__init__()
        self.latent: LatentSpec = LatentSpec("gaussian", m)

        def rand(*shape: int) -> Tensor:
            return torch.randn(*shape, generator=generator, dtype=dtype)

        # λ = e^{0.7} ≈ 2 dominates W D⁻¹ Wᵀ for these scales, so the joint is normalisable.
        self.W = nn.Parameter(0.4 * rand(d, m))
        self.b = nn.Parameter(0.5 * rand(d))
        self.c = nn.Parameter(0.5 * rand(m))
        self.log_d = nn.Parameter(0.3 * rand(m))
        self.log_lam = nn.Parameter(torch.tensor(0.7, dtype=dtype))

    def energy(self, v: Tensor, h: Tensor) -> Tensor:
        """v (B, d), h (B, m) -> (B,)."""
        lam, d, v = self.log_lam.exp(), self.log_d.exp(), v.flatten(1)
        return (
            0.5 * lam * ((v - self.b) ** 2).sum(-1)
            + 0.5 * (d * h * h).sum(-1)
            - ((v @ self.W) * h).sum(-1)
            - h @ self.c
        )

    def free_energy(self, v: Tensor) -> Tensor:
        """F(v) = ½λ‖v − b‖² − ½ aᵀD⁻¹a + ½ Σ log d_j − (m/2) log 2π, a = Wᵀv + c."""
        lam, d, v = self.log_lam.exp(), self.log_d.exp(), v.flatten(1)
        a = v @ self.W + self.c
        m = self.latent.dim
        return (
            0.5 * lam * ((v - self.b) ** 2).sum(-1)
            - 0.5 * (a * a / d).sum(-1)
            + 0.5 * self.log_d.sum()
            - 0.5 * m * math.log(2 * math.pi)
        )

    def posterior_mean(self, v: Tensor) -> Tensor:
        """E[h | v] = D⁻¹(Wᵀv + c): (B, m)."""
        return (v.flatten(1) @ self.W + self.c) / self.log_d.exp()

    def set_exact(self, posterior: nn.Module) -> None:
        """Make a linear Gaussian posterior (``gaussian`` with hidden=[]) equal p(h|v)."""
        m = self.latent.dim
        d = self.log_d.exp()
        head = posterior.head
        assert isinstance(head, nn.Linear), "a linear Gaussian posterior's head is one nn.Linear"
        with torch.no_grad():
            head.weight[:m] = (self.W / d).T
            head.bias[:m] = self.c / d
            head.weight[m:] = 0.0
            head.bias[m:] = -0.5 * self.log_d


def linear_gaussian_parts(d: int = 3, m: int = 2, seed: int = 0) -> tuple[LinearGaussianEBLVM, Posterior, Parts]:
    """(model, linear Gaussian posterior set to the exact posterior, parts) in float64; 200 train points."""
    g = torch.Generator().manual_seed(seed)
    model = LinearGaussianEBLVM(d, m, g)
    data = DataSplits(train=torch.randn(200, d, generator=g, dtype=F64), test=torch.randn(10, d, dtype=F64))
    parts = Parts(dtype=F64, data=data, model=model)
    posterior = make("posteriors", "gaussian", parts, hidden=[]).double()
    model.set_exact(posterior)
    parts.posterior = posterior
    return model, posterior, parts


@attrs.define
class Exact:
    """A model with a known posterior p(h|v), a posterior q set exactly to it, the parts and a batch v.

    ``perturb(scale, seed)`` moves every parameter of q by scale·N(0, 1) noise from the exact
    point; ``reset()`` puts q back at p(h|v).
    """

    name: str
    model: EnergyModel
    posterior: Posterior
    parts: Parts
    v: Tensor
    exact_state: dict[str, Tensor]

    def reset(self) -> None:
        self.posterior.load_state_dict(self.exact_state)

    def perturb(self, scale: float, seed: int) -> None:
        self.reset()
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.posterior.parameters():
                p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _exact(name: str, model: EnergyModel, posterior: Posterior, parts: Parts, n: int) -> Exact:
    state = {k: t.detach().clone() for k, t in posterior.state_dict().items()}
    return Exact(name, model, posterior, parts, parts.data.train[:n], state)


def linear_gaussian_setup(d: int = 3, m: int = 2, n: int = 16, seed: int = 0) -> Exact:
    """The linear-Gaussian EBLVM with a linear Gaussian q = p(h|v) (continuous latents), float64."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model, posterior, parts = linear_gaussian_parts(d, m, seed)
    return _exact("linear-gaussian", model, posterior, parts, n)


def tiny_grbm_setup(
    d: int = 2, m: int = 3, n: int = 16, seed: int = 0, temperature: float = 0.1, coupling: str = "scaled"
) -> Exact:
    """A Gaussian RBM (d visible, m Bernoulli hidden units) with q = p(h|v), float64.

    q is the linear ``bernoulli`` posterior with logits set to c + Uᵀv, the exact GRBM
    posterior (U = W/σ for the ``scaled`` coupling, W for ``plain``). Because E is linear in h,
    log q(h|v) + E(v, h) = F(v) for every h, also for the relaxed samples of ``rsample``.
    """
    g = torch.Generator().manual_seed(seed)
    data = DataSplits(train=torch.randn(64, d, generator=g, dtype=F64), test=torch.randn(16, d, generator=g, dtype=F64))
    parts = Parts(dtype=F64, data=data)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = make(
            "models", "grbm", parts, n_hidden=m, init_weight_std=1.0, init_sigma=0.8, coupling=coupling
        ).double()
        with torch.no_grad():
            model.b.copy_(0.5 * torch.randn(d, generator=g, dtype=F64))
            model.c.copy_(0.5 * torch.randn(m, generator=g, dtype=F64))
        parts.model = model
        posterior = make("posteriors", "bernoulli", parts, hidden=[], temperature=temperature).double()
    with torch.no_grad():
        posterior.net[0].weight.copy_(model.coupling_weight().T)
        posterior.net[0].bias.copy_(model.c)
    assert torch.allclose(posterior.logits(data.train), model.hidden_logits(data.train)), "exact GRBM posterior not set"
    parts.posterior = posterior
    return _exact("tiny-grbm", model, posterior, parts, n)
