"""Toy 2-D data sets: the checkerboard of the BiSM paper."""

from __future__ import annotations

import attrs
import torch

from eblvm.plugin import DataSplits, Parts, hookimpl, option, positive


@attrs.frozen
class CheckerboardConfig:
    n_cols: int = option(2, "the board has n_cols × n_cols squares on [0, 1]²", positive)
    n_train: int = option(60000, "training points", positive)
    n_test: int = option(10000, "test points", positive)
    seed: int = option(0, "seed of the data generator (fixed sets, independent of the run seed)")


def checkerboard_sample(n: int, n_cols: int, generator: torch.Generator) -> torch.Tensor:
    """n points uniform on the squares (i, j) of an n_cols × n_cols board on [0,1]² with i + j even."""
    cells = [(i, j) for i in range(n_cols) for j in range(n_cols) if (i + j) % 2 == 0]
    cells_t = torch.tensor(cells, dtype=torch.float64)
    pick = torch.randint(len(cells), (n,), generator=generator)
    inside = torch.rand(n, 2, generator=generator, dtype=torch.float64)
    return ((cells_t[pick] + inside) / n_cols).float()


def checkerboard(cfg: CheckerboardConfig, parts: Parts) -> DataSplits:
    """The checkerboard toy (BiSM Fig. 2): density 2 on the filled half of the unit square."""
    gen = torch.Generator().manual_seed(cfg.seed)
    train = checkerboard_sample(cfg.n_train, cfg.n_cols, gen)
    test = checkerboard_sample(cfg.n_test, cfg.n_cols, gen)
    return DataSplits(train=train, test=test, bounds=((0.0, 1.0), (0.0, 1.0)))


@hookimpl
def register_datasets(register):
    register("checkerboard", checkerboard, CheckerboardConfig)
