"""Score plugin: the SM, SSM, DSM and KSD objectives and the exact-score baseline estimator."""

from eblvm.plugin import NoConfig, hookimpl
from eblvm_score.estimators import ExactScore, build_exact_score
from eblvm_score.ksd import KSD, KSDConfig, build_ksd
from eblvm_score.objectives import (
    DSM,
    MDSM,
    SM,
    SSM,
    DSMConfig,
    MDSMConfig,
    SSMConfig,
    build_dsm,
    build_mdsm,
    build_sm,
    build_ssm,
)

__all__ = ["DSM", "KSD", "MDSM", "SM", "SSM", "ExactScore"]


@hookimpl
def register_objectives(register):
    register("sm", build_sm, NoConfig)
    register("ssm", build_ssm, SSMConfig)
    register("dsm", build_dsm, DSMConfig)
    register("mdsm", build_mdsm, MDSMConfig)
    register("ksd", build_ksd, KSDConfig)


@hookimpl
def register_estimators(register):
    register("exact-score", build_exact_score, NoConfig)
