"""GRBM plugin: the Gaussian RBM model, its samplers, likelihood evaluators and baselines."""

import functools

from eblvm.plugin import Evaluator, Parts, hookimpl
from eblvm_grbm.ais import AISLoglikConfig, build_ais_loglik
from eblvm_grbm.contrastive import CDConfig, PCDConfig, build_cd, build_pcd
from eblvm_grbm.evaluators import ExactLoglikConfig, PosteriorKLConfig, build_exact_loglik, build_posterior_kl
from eblvm_grbm.fisher import ScoreLossConfig, build_score_loss
from eblvm_grbm.gibbs import GibbsConfig, build_gibbs
from eblvm_grbm.model import GRBM, GRBMConfig, build_grbm

__all__ = ["GRBM", "GRBMConfig"]


@hookimpl
def register_models(register):
    register("grbm", build_grbm, GRBMConfig)


@functools.wraps(build_ais_loglik)
def build_announced_ais_loglik(cfg: AISLoglikConfig, parts: Parts) -> Evaluator:
    # AIS can take minutes: the trainer and `eblvm eval` print this line before it starts.
    evaluate = build_ais_loglik(cfg, parts)
    evaluate.announce = (
        f"AIS: {cfg.n_chains:,} chains × {cfg.n_temps:,} temperatures forward, {cfg.n_reverse_chains:,} chains back…"
    )
    return evaluate


@hookimpl
def register_evaluators(register):
    register("exact-loglik", build_exact_loglik, ExactLoglikConfig, reports=("{split}_loglik", "{split}_loglik_stderr"))
    register(
        "ais-loglik",
        build_announced_ais_loglik,
        AISLoglikConfig,
        reports=(
            "{split}_loglik",
            "{split}_loglik_stderr",
            "{split}_loglik_reverse",
            "log_z",
            "log_z_stderr",
            "log_z_ess",
            "log_z_reverse",
            "log_z_reverse_stderr",
            "log_z_reverse_ess",
            "log_z_gap",
        ),
    )
    register(
        "score-loss", build_score_loss, ScoreLossConfig, reports=("{split}_score_loss", "{split}_score_loss_stderr")
    )
    register(
        "posterior-kl",
        build_posterior_kl,
        PosteriorKLConfig,
        reports=("{split}_posterior_kl", "{split}_posterior_kl_stderr"),
    )


@hookimpl
def register_samplers(register):
    register("gibbs", build_gibbs, GibbsConfig, default_for=("grbm",))


@hookimpl
def register_estimators(register):
    register("cd", build_cd, CDConfig)
    register("pcd", build_pcd, PCDConfig)
