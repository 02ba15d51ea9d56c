"""Metrics plugin: density plots of 2-D models, sample grids, FID, and probes of the posterior (SVM, 2-D embeddings)."""

from eblvm.plugin import hookimpl
from eblvm_metrics.density import DensityPlotConfig, build_density_plot
from eblvm_metrics.fid import FIDConfig, build_fid
from eblvm_metrics.probes import EmbeddingConfig, SVMProbeConfig, build_posterior_embedding, build_svm_probe
from eblvm_metrics.samples import SampleClassesConfig, SampleGridConfig, build_sample_classes, build_sample_grid

__all__ = ["DensityPlotConfig", "SampleGridConfig", "build_density_plot", "build_sample_grid"]


@hookimpl
def register_evaluators(register):
    register("density-plot", build_density_plot, DensityPlotConfig, reports=("grid_mass",))
    register("sample-grid", build_sample_grid, SampleGridConfig)
    register(
        "sample-classes",
        build_sample_classes,
        SampleClassesConfig,
        reports=(
            "samples_confidence",
            "samples_label_entropy",
            "test_confidence",
            "test_label_entropy",
            "noise_confidence",
            "noise_label_entropy",
            "classifier_accuracy",
        ),
    )
    register("fid", build_fid, FIDConfig, reports=("fid",))
    register("svm-probe", build_svm_probe, SVMProbeConfig, reports=("posterior_accuracy", "raw_accuracy"))
    register("posterior-embedding", build_posterior_embedding, EmbeddingConfig)
