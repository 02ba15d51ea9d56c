"""VaGES plugin: variational score (VaES) and score-gradient (VaGES) estimators, the
importance-sampled score baseline, and the exact-Fisher critic evaluator."""

from eblvm.plugin import hookimpl
from eblvm_vages.critic import CriticConfig, build_fisher_critic
from eblvm_vages.estimators import ISConfig, VaGESConfig, build_is_score, build_vaes, build_vages


@hookimpl
def register_estimators(register):
    register("vaes", build_vaes, VaGESConfig)
    register("vages", build_vages, VaGESConfig)
    register("is-score", build_is_score, ISConfig)


@hookimpl
def register_evaluators(register):
    register("fisher-critic", build_fisher_critic, CriticConfig, reports=("fisher",))
