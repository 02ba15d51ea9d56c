"""The Weights & Biases sink (the ``eblvm[wandb]`` extra): scalars, images, the resolved recipe as
the run's config and recipe.toml as a file, in one W&B run per run directory. wandb is imported
when the logger is built, never before."""

from __future__ import annotations

import netrc
import os
import secrets
import string
import sys
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import attrs
from torch import Tensor

from eblvm.plugin import ConfigError, Logger, option, positive
from eblvm.tools import RECIPE

from .common import Guard, RunFile, first_line, image_array, log_section, resolved_recipe, run_label

ID_ALPHABET = string.ascii_lowercase + string.digits  # what W&B run ids are made of
STEP = "step"  # the x-axis of every chart: the optimizer step, logged with each row


@attrs.frozen
class WandbConfig:
    project: str = option("eblvm", "W&B project")
    entity: str | None = option(None, "W&B entity (user or team); None: the account's default")
    name: str | None = option(None, "run name; None: <run name>/<timestamp>, from the run directory")
    group: str | None = option(None, "W&B group, to show runs together (the methods of a comparison)")
    tags: list[str] = option([], "tags of the W&B run")
    mode: Literal["auto", "online", "offline"] = option(
        "auto",
        "online, offline (files under <run_dir>/wandb, uploaded later with wandb sync) or auto: online when "
        "an API key is configured (WANDB_API_KEY, or wandb login), else offline; WANDB_MODE, when set, wins",
    )
    init_timeout: float = option(
        30.0, "seconds to wait for the W&B server at the start; then the run logs offline", positive
    )


def say(line: str) -> None:
    print(f"wandb: {line}", file=sys.stderr, flush=True)


def has_credentials(base_url: str) -> bool:
    """Whether wandb would find an API key without asking: WANDB_API_KEY or WANDB_IDENTITY_TOKEN_FILE,
    or a netrc entry for the W&B host (what ``wandb login`` writes)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    path = os.environ.get("NETRC") or str(Path.home() / (".netrc" if os.name != "nt" else "_netrc"))
    try:
        entries = netrc.netrc(path)
    except (OSError, netrc.NetrcParseError):
        return False
    hosts = {urlsplit(base_url).netloc, "api.wandb.ai"}
    return any(entries.authenticators(host) for host in hosts if host)


def pick_mode(option_mode: str, base_url: str) -> tuple[str, str | None]:
    """(mode for wandb.init, why it is offline when ``auto`` chose so). WANDB_MODE, when set to a
    mode, wins over the recipe: the machine knows whether it has a network."""
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    chosen = {"offline": "offline", "dryrun": "offline", "disabled": "disabled", "online": "online", "run": "online"}
    if env in chosen:
        return chosen[env], None
    if option_mode != "auto":
        return option_mode, None
    if has_credentials(base_url):
        return "online", None
    return "offline", "no W&B API key (wandb login, or WANDB_API_KEY)"


class WandbLogger(Logger):
    """One W&B run per run directory: its id is kept in <run_dir>/wandb/eblvm-run.json, and a
    resumed session continues that run. Rows carry the optimizer step as ``step``, the x-axis of
    every chart; images are wandb.Image; the config is the resolved recipe."""

    def __init__(self, cfg: WandbConfig, run_dir: Path):
        import wandb

        self.wandb = wandb
        self.run_dir = Path(run_dir)
        self.finished = False
        self.guard = Guard("wandb")
        folder = self.run_dir / "wandb"
        record = RunFile(folder)
        run_id = record.read().get("id") or "".join(secrets.choice(ID_ALPHABET) for _ in range(8))
        record.write(id=run_id, project=cfg.project, entity=cfg.entity)
        base_url = str(
            os.environ.get("WANDB_BASE_URL") or getattr(wandb.Settings(), "base_url", None) or "https://api.wandb.ai"
        )
        mode, why = pick_mode(cfg.mode, base_url)
        init = dict(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name or run_label(self.run_dir),
            group=cfg.group,
            tags=list(cfg.tags),
            dir=str(self.run_dir),
            id=run_id,
            resume="allow",
        )

        def start(mode: str) -> Any:
            settings = wandb.Settings(console="off", init_timeout=cfg.init_timeout)
            return wandb.init(mode=mode, settings=settings, **init)

        if why:
            say(f"{why}: logging offline to {folder} (upload it later with: wandb sync {folder}/offline-run-*)")
        try:
            self.run = start(mode)
        except Exception as exc:  # no network, a server that does not answer, a refused key: train anyway
            if mode != "online":
                raise
            say(f"cannot start an online run ({first_line(exc)}); logging offline to {folder} (wandb sync it later)")
            wandb.teardown()  # the failed start still holds the run id in this process
            self.run = start("offline")
        self.run.define_metric(STEP)
        self.run.define_metric("*", step_metric=STEP)
        recipe = resolved_recipe(self.run_dir)
        if recipe:
            self.run.config.update(recipe, allow_val_change=True)
            self.run.save(str(self.run_dir / RECIPE), base_path=str(self.run_dir), policy="now")

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        self.guard(
            f"logging step {step}", lambda: self.run.log({STEP: step, **{k: float(v) for k, v in scalars.items()}})
        )

    def log_images(self, step: int, images: dict[str, Tensor]) -> None:
        def send() -> None:
            self.run.log({STEP: step, **{key: self.wandb.Image(image_array(image)) for key, image in images.items()}})

        self.guard(f"logging the images of step {step}", send)

    def resume(self, step: int) -> None:
        """Nothing to drop: W&B history is append-only. Rows an earlier session logged after the
        checkpoint at ``step`` stay beside the ones the resumed session logs for the same steps (equal
        values when the resumed run reproduces them, as it does on the same device and threads)."""

    def log_hparams(self, hparams: dict[str, float | int | str | bool], metrics: dict[str, float]) -> None:
        """The run finished: its summary gets the final evaluation (the config already holds the recipe)."""
        self.finished = True
        self.guard("writing the summary", lambda: self.run.summary.update(dict(metrics)))

    def close(self) -> None:
        """Finish the W&B run: exit code 0 when the run finished, 1 when it stopped early (interrupted,
        diverged, failed)."""
        self.run.finish(exit_code=0 if self.finished else 1)


def build_wandb(config: WandbConfig, run_dir: Path) -> WandbLogger:
    """Weights & Biases (eblvm[wandb]): scalars, images, the resolved recipe as config and recipe.toml;
    online with an API key, otherwise offline under <run_dir>/wandb (wandb sync uploads it)."""
    try:
        return WandbLogger(config, run_dir)
    except Exception as exc:  # even offline, wandb could not start: one line, not a traceback
        raise ConfigError(log_section(run_dir, "wandb"), None, f"cannot start the W&B run: {first_line(exc)}") from None
