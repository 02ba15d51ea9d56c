"""Variational posteriors q(h|v; φ): Bernoulli (binary-concrete relaxed) and Gaussian (MLP, conv)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, cast

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as _module_hooks

from eblvm.plugin import ConfigError, Parts, Posterior, hookimpl, option, positive
from eblvm.tools import collectives_active, mean_over_ranks

Activation = Literal["elu", "relu", "softplus", "tanh", "silu"]
ACTIVATIONS: dict[str, type[nn.Module]] = {
    "elu": nn.ELU,
    "relu": nn.ReLU,
    "softplus": nn.Softplus,
    "tanh": nn.Tanh,
    "silu": nn.SiLU,
}
LOG_2PI = math.log(2 * math.pi)
RELAXATION_WARNING = 0.2  # a Bernoulli temperature above this biases a relaxed lower level visibly


def mlp(n_in: int, hidden: Sequence[int], n_out: int, activation: str) -> nn.Sequential:
    """Linear layers n_in -> *hidden -> n_out with ``activation`` between them."""
    layers: list[nn.Module] = []
    for width in hidden:
        layers += [nn.Linear(n_in, width), ACTIVATIONS[activation]()]
        n_in = width
    layers.append(nn.Linear(n_in, n_out))
    return nn.Sequential(*layers)


def relaxed_bernoulli(logits: Tensor, u: Tensor, temperature: float) -> Tensor:
    """Binary-concrete sample sigmoid((l + log u − log(1−u)) / T) for uniform u, broadcast over logits."""
    return torch.sigmoid((logits + torch.logit(u, eps=1e-6)) / temperature)


def latent_dim(parts: Parts, kind: str, given: int | None = None) -> int:
    """m: ``given`` (the config's latent_dim) or the model's latent dimension; a ConfigError on
    [posterior] when they disagree or the model's latent is not ``kind``. A fully visible model
    (an encoder beside a marginal energy, as in BiDVL) needs ``given``."""
    model = parts.need("model", "posterior")
    latent = model.latent
    if latent is None:
        if given is not None:
            return given
        raise ConfigError(
            "posterior",
            "kind",
            f"model '{type(model).__name__}' has no latent variable to infer"
            + (" (give latent_dim to use q(h|v) as an encoder)" if kind == "gaussian" else ""),
        )
    if given is not None and given != latent.dim:
        raise ConfigError("posterior", "latent_dim", f"{given} differs from the model's latent dimension {latent.dim}")
    if latent.kind != kind:
        raise ConfigError(
            "posterior", "kind", f"a {kind} posterior cannot approximate the model's {latent.kind} latent variable"
        )
    return latent.dim


def _hooked(net: nn.Module, layer: nn.Module) -> bool:
    """Whether calling ``net`` (which calls ``layer``) would run more than their forward: a hook,
    theirs or a global one, or a compiled forward."""
    return bool(
        net._compiled_call_impl is not None
        or layer._compiled_call_impl is not None
        or _module_hooks._global_forward_hooks
        or _module_hooks._global_forward_pre_hooks
        or _module_hooks._global_backward_hooks
        or _module_hooks._global_backward_pre_hooks
        or net._forward_hooks
        or net._forward_pre_hooks
        or net._backward_hooks
        or net._backward_pre_hooks
        or layer._forward_hooks
        or layer._forward_pre_hooks
        or layer._backward_hooks
        or layer._backward_pre_hooks
    )


# ---- Bernoulli -----------------------------------------------------------------------------


@attrs.frozen
class BernoulliConfig:
    hidden: list[int] = option(
        [], "hidden widths of the logit net; [] is linear (the exact GRBM posterior is then representable)", positive
    )
    activation: Activation = option("elu", "activation between hidden layers")
    temperature: float = option(
        0.1,
        "binary-concrete (Gumbel-softmax) temperature T of rsample; a relaxed lower level (kl) is minimised at the "
        "exact posterior only as T -> 0 (its minimiser's logits are off by about 0.03 at T = 0.2, 0.3 at 0.5, "
        f"0.9 at 1), so above T = {RELAXATION_WARNING} eblvm warns",
        positive,
    )


class BernoulliPosterior(Posterior):
    """q(h|v) = Π_j Bernoulli(h_j; sigmoid(l_j(v))), logits from a linear map or an MLP.

    ``rsample`` returns binary-concrete relaxed samples in (0, 1) at ``temperature``;
    ``log_prob`` is the Bernoulli log-probability Σ_j h_j l_j − softplus(l_j), also for
    relaxed h. That is not the relaxed sample's density, so a lower level such as KL evaluated on
    relaxed samples is minimised at the exact posterior only as the temperature goes to 0.
    """

    def __init__(
        self,
        n_visible: int,
        n_latent: int,
        hidden: Sequence[int] = (),
        activation: str = "elu",
        temperature: float = 0.1,
    ):
        super().__init__()
        self.net: nn.Sequential = mlp(n_visible, hidden, n_latent, activation)
        self.temperature = temperature
        # linear logits (hidden = []) are one F.linear: the two module calls around it cost more
        # than the product on a small model; (net, layer) kept out of the module tree
        self.__dict__["_linear"] = (self.net, self.net[0]) if len(self.net) == 1 else None

    def logits(self, v: Tensor) -> Tensor:
        """v (B, ...) -> logits (B, m)."""
        net = self._modules["net"]
        linear = cast("tuple[nn.Module, nn.Module] | None", self.__dict__["_linear"])
        if (
            net is None
            or linear is None
            or linear[0] is not net
            or type(linear[1]) is not nn.Linear
            or _hooked(net, linear[1])
        ):
            return self.net(v.flatten(1))
        params = cast("dict[str, Tensor]", linear[1]._parameters)  # what Linear.forward reads (and Functional swaps)
        return F.linear(v if v.dim() == 2 else v.flatten(1), params["weight"], params["bias"])

    def _sample(self, logits: Tensor, n: int) -> Tensor:
        u = torch.rand((n, *logits.shape), dtype=logits.dtype, device=logits.device)
        return relaxed_bernoulli(logits, u, self.temperature)

    @staticmethod
    def _log_prob(h: Tensor, logits: Tensor) -> Tensor:
        return (h * logits - F.softplus(logits)).sum(-1)

    def rsample(self, v: Tensor, n: int = 1) -> Tensor:
        """Relaxed samples (n, B, m) in (0, 1), differentiable in φ."""
        return self._sample(self.logits(v), n)

    def sample(self, v: Tensor, n: int = 1) -> Tensor:
        """Exact binary samples (n, B, m), not differentiable."""
        with torch.no_grad():
            probs = torch.sigmoid(self.logits(v))
            return torch.bernoulli(probs.expand(n, *probs.shape))

    def log_prob(self, h: Tensor, v: Tensor) -> Tensor:
        """h (..., B, m) -> (..., B)."""
        return self._log_prob(h, self.logits(v))

    def rsample_and_log_prob(self, v: Tensor, n: int = 1) -> tuple[Tensor, Tensor]:
        """Relaxed samples (n, B, m) and their log-probabilities (n, B), one logit evaluation."""
        logits = self.logits(v)
        h = self._sample(logits, n)
        return h, self._log_prob(h, logits)

    def mean(self, v: Tensor) -> Tensor:
        """sigmoid(logits) (B, m)."""
        return torch.sigmoid(self.logits(v))

    # Closed forms, used by options that are off by default (the exact KL lower level, the
    # natural-gradient unroll and the block solve of the implicit estimator; docs/results.md,
    # "Why BiSSM plateaus below SSM"). Nothing above calls them.

    def mean_and_expected_log_prob(self, v: Tensor) -> tuple[Tensor, Tensor]:
        """E_q[h] = sigmoid(l) (B, m) and E_q[log q(h|v)] = Σ_j q_j l_j − softplus(l_j) (B,), the
        negative entropy, exactly: log q(h|v) is linear in h, so its mean is its value at E_q[h].
        One logit evaluation; differentiable in φ."""
        logits = self.logits(v)
        mean = torch.sigmoid(logits)
        return mean, self._log_prob(mean, logits)

    @property
    def has_fisher_blocks(self) -> bool:
        """Whether ``fisher_blocks`` and ``solve_blocks`` apply: the logits are linear in v."""
        return len(self.net) == 1 and type(self.net[0]) is nn.Linear

    def fisher_blocks(self, v: Tensor) -> FisherBlocks:
        """Per hidden unit j, F_j = mean_b q_bj(1 − q_bj) z_b z_bᵀ with z_b = [1, v_b] (linear logits
        only), at the current φ, detached, kept as its factors (``FisherBlocks``).

        F_j is the Fisher information of q(h_j|v) in unit j's parameters φ_j = (bias_j, weight_j),
        averaged over the points v: the Gauss-Newton matrix of the lower level E_v KL(q ‖ p) for a
        model whose energy is linear in h, and its exact Hessian where q = p(h|v). Units do not
        couple: the Hessian has no entries between two units' parameters.
        """
        if not self.has_fisher_blocks:
            raise ValueError("Fisher blocks need linear logits (hidden = [])")
        with torch.no_grad():
            logits = self.logits(v).double()
            z = F.pad(v.detach().flatten(1).double(), (1, 0), value=1.0)  # (B, d + 1)
            return FisherBlocks.of(z, torch.sigmoid(logits) * torch.sigmoid(-logits))  # q(1 − q), exact in both tails

    def block_names(self) -> tuple[str, str]:
        """Names of (bias, weight) among ``named_parameters()``, the layout ``solve_blocks`` reads."""
        return "net.0.bias", "net.0.weight"

    def solve_blocks(self, blocks: FisherBlocks, vectors: dict[str, Tensor], damping: float) -> dict[str, Tensor]:
        """(F_j + damping·I)⁻¹ g_j for every unit j: ``vectors`` {bias name: (m,), weight name: (m, d)}
        (gradients or any vectors in φ's layout) -> the same layout and dtype. Solved in float64,
        differentiable in ``vectors`` (not in ``blocks``); no host synchronisation."""
        bias, weight = self.block_names()
        g = torch.cat([vectors[bias].unsqueeze(-1), vectors[weight]], -1).double()  # (m, d + 1)
        x = blocks.solve(g, damping)
        return {bias: x[:, 0].to(vectors[bias].dtype), weight: x[:, 1:].to(vectors[weight].dtype)}


@attrs.frozen
class FisherBlocks:
    """m symmetric blocks F_j = mean_b w_bj z_b z_bᵀ (k × k) over n points, float64, no gradient: held
    whole as ``dense`` (m, k, k) where n ≥ k, else as the factors ``z`` (n, k) and ``weight`` (n, m),
    which ``solve`` uses through Woodbury's identity."""

    dense: Tensor | None = None
    z: Tensor | None = None
    weight: Tensor | None = None

    @classmethod
    def of(cls, z: Tensor, weight: Tensor) -> FisherBlocks:
        """The blocks of the points' rows z (n, k) with weights (n, m), in the cheaper form."""
        if len(z) < z.shape[1]:
            return cls(z=z, weight=weight)
        return cls(dense=torch.einsum("bj,bk,bl->jkl", weight, z, z) / len(z))

    def factors(self) -> tuple[Tensor, Tensor]:
        """(z, weight) of blocks held as factors."""
        if self.z is None or self.weight is None:
            raise ValueError("FisherBlocks holds its dense blocks or both factors, z and weight")
        return self.z, self.weight

    def matrices(self) -> Tensor:
        """The blocks (m, k, k)."""
        if self.dense is not None:
            return self.dense
        z, weight = self.factors()
        return torch.einsum("bj,bk,bl->jkl", weight, z, z) / len(z)

    def mean_over_ranks(self) -> FisherBlocks:
        """The blocks averaged over the ranks (held whole), those of the union of their points;
        ``self`` without a process group."""
        if not collectives_active():
            return self
        return FisherBlocks(dense=mean_over_ranks([self.matrices()])[0])

    def solve(self, g: Tensor, damping: float) -> Tensor:
        """(F_j + damping·I)⁻¹ g_j for every row j of g (m, k) -> (m, k), differentiable in g.

        From the factors (fewer points than dimensions, e.g. a batch of 100 Frey faces, k = 561) and
        damping λ > 0, by Woodbury's identity on an n × n system per unit: F_j = S_jᵀS_j with
        S_j = diag(√(w_j/n)) Z, so (λI + S_jᵀS_j)⁻¹g = (g − S_jᵀ(λI + S_jS_jᵀ)⁻¹S_j g)/λ, exact for any
        g, at O(mn²k) instead of the dense blocks' O(nmk² + mk³) time and O(mk²) memory."""
        if self.dense is not None or damping <= 0:
            blocks = self.matrices()
            eye = torch.eye(blocks.shape[-1], dtype=blocks.dtype, device=blocks.device)
            return torch.linalg.solve_ex(blocks + damping * eye, g.unsqueeze(-1))[0].squeeze(-1)
        z, weight = self.factors()
        scale = (weight / len(z)).sqrt().T  # (m, n): S_j = scale_j[:, None] * z
        inner = (z @ z.T).mul(scale[:, :, None]).mul_(scale[:, None, :])  # (m, n, n), no gradient
        inner.diagonal(dim1=-2, dim2=-1).add_(damping)
        y = torch.linalg.solve_ex(inner, (scale * (g @ z.T)).unsqueeze(-1))[0].squeeze(-1)  # (m, n)
        return (g - (scale * y) @ z) / damping


def build_bernoulli(cfg: BernoulliConfig, parts: Parts) -> BernoulliPosterior:
    """Bernoulli q(h|v) with a linear or MLP logit net, relaxed by binary concrete (Gumbel-softmax)."""
    m = latent_dim(parts, "bernoulli")
    if cfg.temperature > RELAXATION_WARNING:
        parts.warn(
            f"[posterior] temperature: {cfg.temperature} > {RELAXATION_WARNING}: a lower level on relaxed samples "
            "(kl) is then minimised visibly away from the exact posterior (logits off by about 0.3 at T = 0.5)"
        )
    return BernoulliPosterior(parts.need("data", "posterior").dim, m, cfg.hidden, cfg.activation, cfg.temperature)


# ---- Gaussian ------------------------------------------------------------------------------


class GaussianPosterior(Posterior):
    """q(h|v) = N(μ(v), diag σ(v)²): ``trunk`` maps v to features, one linear ``head`` to [μ, r].

    ``variance`` says what the head's second half r is: "log-std" r = log σ; "log-var" r = log σ²
    (BiDVL's released conv encoder); "bounded" log σ² = −softplus(r) < 0, every variance below 1
    (BiDVL's released ResNet encoder).
    """

    def __init__(
        self,
        trunk: nn.Module,
        n_features: int,
        n_latent: int,
        variance: Literal["log-std", "log-var", "bounded"] = "log-std",
    ):
        super().__init__()
        self.trunk = trunk
        self.head: nn.Module = nn.Linear(n_features, 2 * n_latent)
        self.variance = variance

    def params(self, v: Tensor) -> tuple[Tensor, Tensor]:
        """v (B, ...) -> (μ, log σ), each (B, m)."""
        mu, raw = self.head(self.trunk(v)).chunk(2, dim=-1)
        if self.variance == "log-var":
            return mu, 0.5 * raw
        return (mu, -0.5 * F.softplus(raw)) if self.variance == "bounded" else (mu, raw)

    @staticmethod
    def _sample(mu: Tensor, log_std: Tensor, n: int) -> Tensor:
        eps = torch.randn((n, *mu.shape), dtype=mu.dtype, device=mu.device)
        return mu + log_std.exp() * eps

    @staticmethod
    def _log_prob(h: Tensor, mu: Tensor, log_std: Tensor) -> Tensor:
        z = (h - mu) * torch.exp(-log_std)
        return -(0.5 * z * z + log_std).sum(-1) - 0.5 * LOG_2PI * mu.shape[-1]

    def rsample(self, v: Tensor, n: int = 1) -> Tensor:
        """μ + σ·ε, ε ~ N(0, I): (n, B, m)."""
        return self._sample(*self.params(v), n)

    def log_prob(self, h: Tensor, v: Tensor) -> Tensor:
        """h (..., B, m) -> (..., B)."""
        return self._log_prob(h, *self.params(v))

    def rsample_and_log_prob(self, v: Tensor, n: int = 1) -> tuple[Tensor, Tensor]:
        """Samples (n, B, m) and their log-densities (n, B), one network evaluation; the
        log-density is computed from h itself, so its ∇_h is exact."""
        mu, log_std = self.params(v)
        h = self._sample(mu, log_std, n)
        return h, self._log_prob(h, mu, log_std)

    def mean(self, v: Tensor) -> Tensor:
        """μ(v) (B, m)."""
        return self.params(v)[0]


@attrs.frozen
class GaussianConfig:
    hidden: list[int] = option([256], "hidden widths of the MLP trunk; [] makes μ and log σ linear in v", positive)
    activation: Activation = option("elu", "activation between layers")
    latent_dim: int | None = option(
        None, "m; default the model's latent dimension (required with a fully visible model)", positive
    )


def build_gaussian(cfg: GaussianConfig, parts: Parts) -> GaussianPosterior:
    """Gaussian q(h|v) with an MLP trunk and linear mean and log-std heads."""
    m = latent_dim(parts, "gaussian", cfg.latent_dim)
    d = parts.need("data", "posterior").dim
    layers: list[nn.Module] = [nn.Flatten()]
    width = d
    for w in cfg.hidden:
        layers += [nn.Linear(width, w), ACTIVATIONS[cfg.activation]()]
        width = w
    return GaussianPosterior(nn.Sequential(*layers), width, m)


@attrs.frozen
class GaussianConvConfig:
    channels: int = option(32, "channels of the first conv layer (then 2x, 4x)", positive)
    activation: Activation = option("elu", "activation between layers")
    image_shape: list[int] | None = option(
        None, "[C, H, W]; default: the data set's image shape, else the data's own shape"
    )
    latent_dim: int | None = option(
        None, "m; default the model's latent dimension (required with a fully visible model)", positive
    )


class ConvTrunk(nn.Module):
    """Three conv layers (3x3 stride 1, 4x4 stride 2, 4x4 stride 2) on v reshaped to (B, C, H, W)."""

    def __init__(self, image_shape: tuple[int, int, int], channels: int, activation: str):
        super().__init__()
        self.image_shape = image_shape
        act = ACTIVATIONS[activation]
        c = channels
        self.net = nn.Sequential(
            nn.Conv2d(image_shape[0], c, 3, 1, 1),
            act(),
            nn.Conv2d(c, 2 * c, 4, 2, 1),
            act(),
            nn.Conv2d(2 * c, 4 * c, 4, 2, 1),
            act(),
            nn.Flatten(),
        )

    def forward(self, v: Tensor) -> Tensor:
        return self.net(v.reshape(v.shape[0], *self.image_shape))


def build_gaussian_conv(cfg: GaussianConvConfig, parts: Parts) -> GaussianPosterior:
    """Gaussian q(h|v) for images: a 3-layer conv trunk and linear mean and log-std heads."""
    m = latent_dim(parts, "gaussian", cfg.latent_dim)
    data = parts.need("data", "posterior")
    shape = tuple(cfg.image_shape or data.image_shape or data.shape)
    if len(shape) == 2:
        shape = (1, *shape)
    if len(shape) != 3 or math.prod(shape) != data.dim:
        raise ConfigError(
            "posterior",
            "image_shape",
            f"need [C, H, W] with C·H·W = {data.dim} (data shape {data.shape}), got {list(shape)}",
        )
    trunk = ConvTrunk(shape, cfg.channels, cfg.activation)
    with torch.no_grad():
        n_features = trunk(torch.zeros(1, data.dim)).shape[1]
    return GaussianPosterior(trunk, n_features, m)


@attrs.frozen
class GaussianConv3Config:
    channels: int = option(64, "channels of the first stride-2 conv (then 2x, 4x: the papers' 64/128/256)", positive)
    negative_slope: float = option(0.2, "slope of the LeakyReLU for negative inputs")
    spectral_norm: bool = option(False, "spectral normalisation on the convs and heads")
    latent_dim: int | None = option(
        None, "m; default the model's latent dimension (required with a fully visible model)", positive
    )


def build_gaussian_conv3(cfg: GaussianConv3Config, parts: Parts) -> GaussianPosterior:
    """The papers' image posterior: three 3×3 stride-2 convs (64/128/256, LeakyReLU 0.2), linear mean and log-std heads."""
    m = latent_dim(parts, "gaussian", cfg.latent_dim)
    shape = parts.need("data", "posterior").image_shape
    if shape is None:
        raise ConfigError(
            "posterior", "kind", f"gaussian-conv3 reads images (C, H, W); the data's examples are {parts.data.shape}"
        )
    c = cfg.channels
    layers: list[nn.Module] = []
    for c_in, c_out in ((shape[0], c), (c, 2 * c), (2 * c, 4 * c)):
        layers += [nn.Conv2d(c_in, c_out, 3, stride=2, padding=1), nn.LeakyReLU(cfg.negative_slope)]
    if cfg.spectral_norm:
        from torch.nn.utils.parametrizations import spectral_norm

        layers = [spectral_norm(layer) if isinstance(layer, nn.Conv2d) else layer for layer in layers]
    trunk = nn.Sequential(*layers, nn.Flatten())
    with torch.no_grad():
        n_features = trunk(torch.zeros(1, *shape)).shape[1]
    posterior = GaussianPosterior(trunk, n_features, m)
    if cfg.spectral_norm:
        posterior.head = spectral_norm(posterior.head)
    return posterior


@attrs.frozen
class GaussianDCGANConfig:
    base: int = option(
        48, "channels of the first conv (doubled at each stride-2 conv; BiDVL's released code: 48)", positive
    )
    bounded_variance: bool = option(
        False,
        "log σ² = −softplus(head): variances below 1 (BiDVL's ResNet encoder, appendix B); "
        "false: the head is a free log σ² (its conv encoder)",
    )
    latent_dim: int | None = option(
        None, "m; default the model's latent dimension (required with a fully visible model)", positive
    )
    init_std: float | None = option(
        None,
        "conv and head weights drawn from N(0, init_std²) (BiDVL's released code: 0.02); None: torch's default",
        positive,
    )


def build_gaussian_dcgan(cfg: GaussianDCGANConfig, parts: Parts) -> GaussianPosterior:
    """DCGAN-style image encoder (3×3 conv, then 4×4 stride-2 convs with batch norm and LeakyReLU 0.2 down to 4×4), Gaussian heads."""
    m = latent_dim(parts, "gaussian", cfg.latent_dim)
    shape = parts.need("data", "posterior").image_shape
    if shape is None or shape[1] != shape[2] or shape[1] < 4 or shape[1] & (shape[1] - 1):
        raise ConfigError(
            "posterior",
            "kind",
            f"gaussian-dcgan reads square images with a power-of-two side ≥ 4; the data's examples are {parts.data.shape}",
        )
    c = cfg.base
    layers: list[nn.Module] = [nn.Conv2d(shape[0], c, 3, 1, 1, bias=False), nn.BatchNorm2d(c), nn.LeakyReLU(0.2)]
    side = shape[1]
    while side > 4:
        layers += [nn.Conv2d(c, 2 * c, 4, 2, 1, bias=False), nn.BatchNorm2d(2 * c), nn.LeakyReLU(0.2)]
        c, side = 2 * c, side // 2
    trunk = nn.Sequential(*layers, nn.Flatten())
    posterior = GaussianPosterior(trunk, c * 16, m, "bounded" if cfg.bounded_variance else "log-var")
    init_std = cfg.init_std
    for module in posterior.modules() if init_std is not None else ():
        if init_std is not None and isinstance(
            module, (nn.Conv2d, nn.Linear)
        ):  # the head: the released code's 4×4 convs
            nn.init.normal_(module.weight, 0.0, init_std)
    return posterior


@hookimpl
def register_posteriors(register):
    register("bernoulli", build_bernoulli, BernoulliConfig)
    register("gaussian", build_gaussian, GaussianConfig)
    register("gaussian-conv", build_gaussian_conv, GaussianConvConfig)
    register("gaussian-conv3", build_gaussian_conv3, GaussianConv3Config)
    register("gaussian-dcgan", build_gaussian_dcgan, GaussianDCGANConfig)
