"""The MLflow sink (the ``eblvm[mlflow]`` extra): metrics at their steps, images, the flattened
hyper-parameters as params and recipe.toml as an artifact, in one MLflow run per run directory.
mlflow is imported when the logger is built, never before."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
from torch import Tensor

from eblvm.plugin import ConfigError, Logger, option
from eblvm.tools import RECIPE, hyperparameters

from .common import Guard, RunFile, first_line, image_array, log_section, resolved_recipe, run_label

PARAM_LIMIT = 500  # MLflow's limit on a param's length before 2.x raised it (6000); the installed one is used
BATCH = 100  # params (and tags) per log_batch call: MLflow's limit
METRICS_BATCH = 1000


@attrs.frozen
class MLflowConfig:
    tracking_uri: str | None = option(
        None,
        "where runs are recorded: a tracking server (http://host:5000) or a database (sqlite:///path.db); "
        "None: $MLFLOW_TRACKING_URI when set, else the database <run_dir>/mlflow/mlflow.db",
    )
    experiment: str = option("eblvm", "MLflow experiment (created when missing)")
    name: str | None = option(None, "run name; None: <run name>/<timestamp>, from the run directory")
    tags: dict[str, str] = option({}, 'tags of the MLflow run, e.g. {team = "vision"}')
    artifact_location: str | None = option(
        None,
        "where a new experiment stores artifacts (images, recipe.toml); None: <run_dir>/mlflow/artifacts "
        "with the default database, the tracking server's default otherwise",
    )


def say(line: str) -> None:
    print(f"mlflow: {line}", file=sys.stderr, flush=True)


def metric_key(key: str) -> str:
    """A key MLflow accepts: letters, digits, ``_ - . / :`` and spaces; anything else becomes ``_``."""
    return re.sub(r"[^\w\-./: ]", "_", key)


def param_text(value: Any, limit: int) -> str:
    """A param's value as text (booleans as TOML writes them), cut to MLflow's length limit with a
    marker: the whole value is in the recipe.toml artifact."""
    text = ("true" if value else "false") if isinstance(value, bool) else str(value)
    marker = "... (cut; see recipe.toml)"
    return text if len(text) <= limit else text[: limit - len(marker)] + marker


@contextlib.contextmanager
def quiet_setup() -> Iterator[None]:
    """Hide MLflow's and alembic's INFO lines while a new database is set up."""
    loggers = [logging.getLogger(name) for name in ("mlflow.store.db.utils", "alembic")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eblvm" / "mlflow"


def local_database(folder: Path) -> str:
    """``sqlite:///<folder>/mlflow.db``. MLflow sets up a new database in seconds (its schema
    migrations, one by one); an empty one is kept in the user cache per MLflow version and copied,
    which takes milliseconds. Without a writable cache MLflow sets the database up in place."""
    import mlflow
    from mlflow import MlflowClient

    db = folder / "mlflow.db"
    if not db.exists():
        template = cache_dir() / f"empty-{mlflow.__version__}.db"
        tmp = template.with_name(f".{template.name}.{os.getpid()}.tmp")
        try:
            if not template.is_file():
                template.parent.mkdir(parents=True, exist_ok=True)
                with quiet_setup():
                    MlflowClient(tracking_uri=f"sqlite:///{tmp.resolve()}")
                os.replace(tmp, template)
            shutil.copyfile(template, db)
        except Exception:  # no cache: MLflow sets the database up in place
            for leftover in (tmp, db):
                with contextlib.suppress(OSError):
                    leftover.unlink(missing_ok=True)
    return f"sqlite:///{db.resolve()}"


class MLflowLogger(Logger):
    """One MLflow run per run directory: its id is kept in <run_dir>/mlflow/eblvm-run.json, and a
    resumed session continues that run (status RUNNING again). Params are the flattened recipe
    (``model.n_hidden``), values cut to MLflow's length limit; images are logged with
    ``log_image`` at their step; recipe.toml is an artifact. The status is FINISHED when the run
    finished, KILLED when it stopped before (interrupted, diverged, failed)."""

    def __init__(self, cfg: MLflowConfig, run_dir: Path):
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        try:
            from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH as limit
        except ImportError:
            limit = PARAM_LIMIT
        self.limit = limit
        self.run_dir = Path(run_dir)
        self.finished = False
        self.guard = Guard("mlflow")
        folder = self.run_dir / "mlflow"
        folder.mkdir(exist_ok=True)
        local = not (cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"))
        uri = cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or local_database(folder)
        record = RunFile(folder)
        saved = record.read()
        with quiet_setup():
            self.client = MlflowClient(tracking_uri=uri)
        run = None
        if saved.get("run_id") and saved.get("tracking_uri") == uri:
            try:
                run = self.client.get_run(saved["run_id"])
            except MlflowException:
                say(f"run {saved['run_id']} is not in {uri} any more: starting a new run")
        if run is None:
            location = cfg.artifact_location or ((folder / "artifacts").resolve().as_uri() if local else None)
            experiment = self._experiment(cfg.experiment, location)
            tags = {str(k): str(v) for k, v in cfg.tags.items()}
            run = self.client.create_run(experiment, run_name=cfg.name or run_label(self.run_dir), tags=tags)
        else:
            self.client.update_run(run.info.run_id, status="RUNNING")
        self.run_id = run.info.run_id
        record.write(tracking_uri=uri, experiment_id=run.info.experiment_id, run_id=self.run_id)
        self.logged = dict(run.data.params)
        self._params(hyperparameters(resolved_recipe(self.run_dir)))
        if (self.run_dir / RECIPE).is_file():
            self.client.log_artifact(self.run_id, str(self.run_dir / RECIPE))

    def _experiment(self, name: str, location: str | None) -> str:
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(name)
        if found is None:
            try:
                return self.client.create_experiment(name, artifact_location=location)
            except MlflowException:  # created meanwhile by another run
                found = self.client.get_experiment_by_name(name)
                if found is None:
                    raise
        return found.experiment_id

    def _params(self, hparams: dict[str, Any]) -> None:
        """Log the params the run lacks. MLflow never changes a param: a value a resumed session
        changed (run.steps, an interval, the device) goes to the tag ``resumed.<key>``."""
        from mlflow.entities import Param, RunTag

        values = {key: param_text(value, self.limit) for key, value in hparams.items()}
        new = [Param(key, text) for key, text in values.items() if key not in self.logged]
        changed = [RunTag(f"resumed.{key}", text) for key, text in values.items() if self.logged.get(key, text) != text]
        for i in range(0, max(len(new), len(changed)), BATCH):
            self.client.log_batch(self.run_id, params=new[i : i + BATCH], tags=changed[i : i + BATCH])
        self.logged.update({p.key: p.value for p in new})

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(metric_key(key), float(value), now, int(step)) for key, value in scalars.items()]

        def send() -> None:
            for i in range(0, len(metrics), METRICS_BATCH):
                self.client.log_batch(self.run_id, metrics=metrics[i : i + METRICS_BATCH])

        self.guard(f"logging step {step}", send)

    def log_images(self, step: int, images: dict[str, Tensor]) -> None:
        def send() -> None:
            for key, image in images.items():
                self.client.log_image(self.run_id, image_array(image), key=metric_key(key), step=int(step))

        self.guard(f"logging the images of step {step}", send)

    def resume(self, step: int) -> None:
        """Nothing to drop: MLflow cannot delete logged metric values. Values an earlier session
        logged after the checkpoint at ``step`` stay beside those the resumed session logs for the
        same steps (equal when the resumed run reproduces them, as on the same device and threads)."""

    def log_hparams(self, hparams: dict[str, float | int | str | bool], metrics: dict[str, float]) -> None:
        """The run finished: params it lacks (none, as they were logged from recipe.toml at the start)."""
        self.finished = True
        self.guard("logging the params", lambda: self._params(hparams))

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if self.finished else "KILLED")


def build_mlflow(config: MLflowConfig, run_dir: Path) -> MLflowLogger:
    """MLflow (eblvm[mlflow]): metrics at their steps, images, the flattened recipe as params and
    recipe.toml as an artifact; in <run_dir>/mlflow/mlflow.db unless a tracking URI is given."""
    try:
        return MLflowLogger(config, run_dir)
    except Exception as exc:  # an unreachable server, a refused login, a deleted experiment: one line
        raise ConfigError(
            log_section(run_dir, "mlflow"), None, f"cannot start the MLflow run: {first_line(exc)}"
        ) from None
