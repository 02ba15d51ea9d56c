"""Likelihood evaluators for GRBMs."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any, Literal

import attrs
import torch
import torch.nn.functional as F

from eblvm.plugin import ConfigError, EvalResult, Parts, option, positive, reporting
from eblvm_grbm.model import MAX_ENUMERATED_HIDDEN, default_chunk

ANNOUNCE_STATES = 2**24  # enumerations of more hidden states than this say how long they will take


def enumerable(_inst: Any, attribute: attrs.Attribute, value: int) -> None:
    """Validator for max_hidden ≤ MAX_ENUMERATED_HIDDEN, the most hidden units exact log Z may enumerate."""
    if value > MAX_ENUMERATED_HIDDEN:
        raise ValueError(
            f"must be at most {MAX_ENUMERATED_HIDDEN}, got {value}: exact-loglik enumerates 2^m hidden states "
            f"(in chunks, so memory stays bounded) and 2^{MAX_ENUMERATED_HIDDEN} ≈ {2.0**MAX_ENUMERATED_HIDDEN:.1e} "
            "of them already take days on a CPU; use the ais-loglik evaluator for larger models"
        )


@attrs.frozen
class ExactLoglikConfig:
    split: Literal["test", "train", "val"] = option("test", "data split to average log p(v) over")
    max_hidden: int = option(
        20,
        f"refuse models with more hidden units than this, at most {MAX_ENUMERATED_HIDDEN} "
        "(time grows as 2^m; memory stays bounded)",
        [positive, enumerable],
    )
    batch_size: int = option(10000, "points per free-energy evaluation", positive)


def build_exact_loglik(cfg: ExactLoglikConfig, parts: Parts) -> Callable[[Parts], EvalResult]:
    """Mean exact log p(v) in nats, enumerating the 2^m hidden states for log Z, and its standard
    error over the split's points (sample sd / √n: the test set's own sampling error).
    """
    model = parts.need("model", "")
    data = parts.need("data", "")
    if not (callable(getattr(model, "log_partition", None)) and model.has_free_energy and model.latent is not None):
        raise ConfigError(
            "",
            "kind",
            f"exact-loglik needs a GRBM-like model with free_energy and log_partition; {type(model).__name__} has not both",
        )
    m = model.latent.dim
    if m > cfg.max_hidden:
        raise ConfigError(
            "",
            "max_hidden",
            f"exact-loglik enumerates 2^m hidden states and the model has m={m} > max_hidden={cfg.max_hidden}; "
            f"use the ais-loglik evaluator, or raise max_hidden (at most {MAX_ENUMERATED_HIDDEN}) "
            f"if 2^{m} states are worth the time",
        )
    if not data.has(cfg.split):
        raise ConfigError("", "split", f"the dataset has no '{cfg.split}' split")
    key = f"{cfg.split}_loglik"
    large = 2**m > ANNOUNCE_STATES

    @reporting([key, f"{key}_stderr"])
    def evaluate(parts: Parts) -> EvalResult:
        model, v = parts.model, parts.data.tensor(cfg.split)
        with torch.no_grad():
            log_z = model.log_partition(cfg.max_hidden, progress=time_estimate() if large else None)
            loglik = torch.cat(
                [
                    (-model.free_energy(chunk.reshape(len(chunk), -1)) - log_z).double()
                    for chunk in v.split(cfg.batch_size)
                ]
            )
        return EvalResult.mean_over_points(key, loglik)

    if large:  # the trainer and `eblvm eval` print this line before it starts
        chunk = default_chunk(data.dim, m)
        evaluate.announce = (
            f"log Z over 2^{m} = {2**m:,} hidden states in {math.ceil(2**m / chunk):,} chunks of {chunk:,}; "
            "an estimate of the time left follows…"
        )
    return evaluate


def time_estimate(after: float = 1.0) -> Callable[[int, int], None]:
    """A ``log_partition`` progress callback that prints once on stderr, at the first chunk ending
    ``after`` seconds or more from its creation, how long the rest will take at the rate so far."""
    start = time.perf_counter()
    said = False

    def progress(done: int, total: int) -> None:
        nonlocal said
        elapsed = time.perf_counter() - start
        if not said and elapsed >= after and done < total:
            said = True
            print(
                f"exact-loglik: {done:,} of {total:,} hidden states in {elapsed:.2g} s: "
                f"about {about(elapsed * (total - done) / done)} to go",
                file=sys.stderr,
            )

    return progress


UNITS = (("days", 86400.0), ("h", 3600.0), ("min", 60.0))


def about(seconds: float) -> str:
    """A duration in the largest unit that keeps it ≥ 1: '0.42 s', '3.5 min', '21 h', '130 days'."""
    value, unit = next(((seconds / size, unit) for unit, size in UNITS if seconds >= size), (seconds, "s"))
    return f"{value:.2g} {unit}" if value < 10 else f"{value:,.0f} {unit}"


@attrs.frozen
class PosteriorKLConfig:
    split: Literal["test", "train", "val"] = option("test", "data split to average the divergence over")
    n: int = option(1000, "points averaged (the first n of the split)", positive)


def bernoulli_kl(q_logits: torch.Tensor, p_logits: torch.Tensor) -> torch.Tensor:
    """KL(Bern(σ(a)) ‖ Bern(σ(b))) summed over the last dimension, from logits a, b (..., m) -> (...), in float64.

    Written with log σ, so it stays finite and accurate for any finite logits: from probabilities
    in float32, σ rounds to 1 beyond a logit of about 17 and the KL came out nan or inf.
    """
    a, b = q_logits.double(), p_logits.double()
    log_q, log_p, log_not_q, log_not_p = (F.logsigmoid(x) for x in (a, b, -a, -b))
    return (log_q.exp() * (log_q - log_p) + log_not_q.exp() * (log_not_q - log_not_p)).sum(-1)


def build_posterior_kl(cfg: PosteriorKLConfig, parts: Parts) -> Callable[[Parts], EvalResult]:
    """Exact KL(q(h|v) ‖ p(h|v)) of a factorised Bernoulli posterior against a GRBM's, which factorises too: how good q is."""
    from eblvm_grbm.gibbs import require_grbm

    require_grbm(parts.need("model", ""), "", "posterior-kl")
    posterior = parts.need("posterior", "")
    if not hasattr(posterior, "logits"):
        raise ConfigError(
            "", "kind", f"posterior-kl needs a factorised Bernoulli posterior (logits); got {type(posterior).__name__}"
        )
    if not parts.need("data", "").has(cfg.split):
        raise ConfigError("", "split", f"the dataset has no '{cfg.split}' split")

    @reporting([f"{cfg.split}_posterior_kl", f"{cfg.split}_posterior_kl_stderr"])
    def evaluate(parts: Parts) -> EvalResult:
        """Mean over points of Σ_j KL(Bern(σ(l_j(v))) ‖ Bern(σ(c_j + (Uᵀv)_j))), in nats, and its standard error."""
        v = parts.data.tensor(cfg.split, cfg.n)
        with torch.no_grad():
            values = bernoulli_kl(parts.posterior.logits(v), parts.model.hidden_logits(v))
        return EvalResult.mean_over_points(f"{cfg.split}_posterior_kl", values)

    return evaluate
