"""Experiment trackers as loggers: a CSV table (always available), Weights & Biases (the
``eblvm[wandb]`` extra) and MLflow (``eblvm[mlflow]``). The optional packages are imported only
when their logger is built; a recipe that names one that is not installed is refused when it is
read (``eblvm validate`` too), in one line naming its [[log]] section and the pip command."""

from __future__ import annotations

from eblvm.plugin import hookimpl

from .csv_logger import CSVConfig, CSVLogger, build_csv
from .mlflow_logger import MLflowConfig, MLflowLogger, build_mlflow
from .wandb_logger import WandbConfig, WandbLogger, build_wandb

__all__ = ["CSVLogger", "MLflowLogger", "WandbLogger"]


@hookimpl
def register_loggers(register):
    register("csv", build_csv, CSVConfig)
    register("wandb", build_wandb, WandbConfig, requires="wandb", extra="wandb")
    register("mlflow", build_mlflow, MLflowConfig, requires="mlflow", extra="mlflow")
