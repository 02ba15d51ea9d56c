"""Metrics plugin: evaluators that report figures and scalars (density plots of 2-D models)."""

from eblvm_core.hookspecs import hookimpl
from eblvm_metrics.density import DensityPlotConfig, build_density_plot
from eblvm_metrics.samples import SampleGridConfig, build_sample_grid

__all__ = ["DensityPlotConfig", "SampleGridConfig", "build_density_plot", "build_sample_grid"]


@hookimpl
def register_evaluators(register):
    register("density-plot", build_density_plot, DensityPlotConfig)
    register("sample-grid", build_sample_grid, SampleGridConfig)
