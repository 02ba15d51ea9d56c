"""Samplers plugin: MALA and HMC with step sizes adapted by dual averaging, and parallel tempering,
each reporting its acceptance, effective sample size and split R-hat with the samples."""

from eblvm.plugin import hookimpl
from eblvm_samplers.gradient import HMCConfig, MALAConfig, build_hmc, build_mala
from eblvm_samplers.tempering import TemperingConfig, build_tempering


@hookimpl
def register_samplers(register):
    register("mala", build_mala, MALAConfig)
    register("hmc", build_hmc, HMCConfig)
    register("tempering", build_tempering, TemperingConfig)
