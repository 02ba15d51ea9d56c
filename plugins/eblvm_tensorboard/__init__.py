"""TensorBoard sink: scalars and images of a run, under <run_dir>/tensorboard."""

from __future__ import annotations

from pathlib import Path

import attrs
from torch import Tensor

from eblvm.plugin import Logger, hookimpl, option, positive


@attrs.frozen
class TensorBoardConfig:
    subdir: str = option("tensorboard", "folder inside the run directory for the event files")
    flush_secs: int = option(30, "seconds between flushes to disk", positive)


class TensorBoardLogger(Logger):
    """Writes scalars (losses, learning rates, gradient norms, steps per second, evaluator results),
    images, and the hyper-parameters with the final metrics (the HPARAMS dashboard)."""

    def __init__(self, cfg: TensorBoardConfig, run_dir: Path):
        self.folder, self.flush_secs = str(Path(run_dir) / cfg.subdir), cfg.flush_secs
        self.writer = self._writer()

    def _writer(self, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(self.folder, flush_secs=self.flush_secs, purge_step=purge_step)

    def resume(self, step: int) -> None:
        """A new event file whose start marker makes TensorBoard hide the earlier files' events
        after ``step`` (they are logged again)."""
        self.writer.close()
        self.writer = self._writer(purge_step=step + 1)

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def log_images(self, step: int, images: dict[str, Tensor]) -> None:
        for key, image in images.items():
            self.writer.add_image(key, image.detach().float().cpu().clamp(0, 1), step, dataformats="CHW")

    def log_hparams(self, hparams: dict[str, float | int | str | bool], metrics: dict[str, float]) -> None:
        """The HPARAMS dashboard's record of this run: its hyper-parameters, and the final metrics
        by tag (their values are the scalars logged under those tags)."""
        from torch.utils.tensorboard.summary import hparams as summaries

        for summary in summaries(hparams, metrics):
            self.writer.file_writer.add_summary(summary)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


@hookimpl
def register_loggers(register):
    register("tensorboard", TensorBoardLogger, TensorBoardConfig)
