"""Training batches for every data set: in memory or through DataLoader workers, sharded by rank,
reproducible per (seed, epoch, rank), checkpointable; and the image transforms data sets offer.

``run.batch_size`` is global: with world size W each rank draws B/W examples of every batch, so
W ranks together see exactly the batches one process would.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import attrs
import torch
from torch import Tensor

from eblvm_core.config import non_negative, option
from eblvm_core.contracts import DataSplits


class EpochOrder:
    """The permutation of n examples for each epoch, a function of (seed, epoch) only.

    Epoch e's order is the (e+1)-th ``randperm(n)`` of a generator seeded with ``seed``, so a
    stream of epochs equals one generator drawing permutation after permutation; a later epoch
    is reached by replaying the draws (milliseconds per epoch), e.g. on resume.
    """

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self._generator = torch.Generator().manual_seed(seed)
        self._epoch, self._order = -1, torch.empty(0, dtype=torch.long)

    def __call__(self, epoch: int) -> Tensor:
        """The order of ``epoch``: cached, drawn next, or replayed from the seed for an earlier epoch."""
        if epoch < self._epoch:
            self._generator.manual_seed(self.seed)
            self._epoch = -1
        while self._epoch < epoch:
            self._order = torch.randperm(self.n, generator=self._generator)
            self._epoch += 1
        return self._order


class Shards:
    """This rank's example indices: batch i of epoch e is ``order(e)[i·B : (i+1)·B]`` (the last
    partial batch of an epoch is dropped) and rank r takes the r-th of W equal slices of it.
    Iterated (as a DataLoader's batch sampler) it yields the batches of epoch ``start[0]``
    from position ``start[1]`` on."""

    def __init__(self, n: int, batch_size: int, seed: int, rank: int, world_size: int):
        if batch_size % world_size:
            raise ValueError(f"batch size {batch_size} is not divisible by the world size {world_size}")
        self.order, self.batch_size, self.rank, self.world_size = EpochOrder(n, seed), batch_size, rank, world_size
        self.steps_per_epoch = n // batch_size
        self.start = (0, 0)

    def span(self, pos: int) -> slice:
        """Where this rank's part of batch ``pos`` lies in an epoch's order."""
        per_rank = self.batch_size // self.world_size
        first = pos * self.batch_size + self.rank * per_rank
        return slice(first, first + per_rank)

    def indices(self, epoch: int, pos: int) -> Tensor:
        return self.order(epoch)[self.span(pos)]

    def __iter__(self) -> Iterator[list[int]]:
        epoch, pos = self.start
        for i in range(pos, self.steps_per_epoch):
            yield self.indices(epoch, i).tolist()

    def __len__(self) -> int:
        return self.steps_per_epoch - self.start[1]


BLOCK_BYTES = 1 << 20  # in memory, the batches of an epoch are indexed this many bytes of them at a time


class Batches:
    """An endless stream of training batches (B/W, *event_shape) on ``device``, prepared and augmented.

    The examples of each batch come from ``Shards``. In-memory tensors are indexed on their
    device, the next batches of the epoch, up to BLOCK_BYTES of them, in one indexing (a small
    model's step is over before a batch's own indexing would be); a Dataset is read by
    ``data.workers`` DataLoader processes (pinned memory and non-blocking copies on CUDA). The
    random augmentation of each batch uses a generator seeded from (seed, epoch, batch, rank), so
    batches do not depend on workers, resumes or timing. ``state_dict`` is (epoch, batches
    consumed in it).
    """

    def __init__(
        self,
        data: DataSplits,
        batch_size: int,
        seed: int,
        device: torch.device,
        dtype: torch.dtype,
        rank: int = 0,
        world_size: int = 1,
        split: str = "train",
        augment: bool = True,
    ):
        self.data, self.device, self.dtype = data, torch.device(device), dtype
        self.store = getattr(data, split)
        self.shards = Shards(len(self.store), min(batch_size, len(self.store)), seed, rank, world_size)
        self.steps_per_epoch = self.shards.steps_per_epoch
        self.seed, self.rank, self.use_augment = seed, rank, augment
        self.epoch, self.pos = 0, 0  # the position after the batches next() has returned (checkpointed)
        self._cursor = (0, 0)  # the position after the batches drawn, one more than ``pos`` after a prefetch
        self._ahead: tuple[Tensor, tuple[int, int]] | None = None  # a prefetched batch and the position after it
        self._iter: Iterator[Tensor] | None = None
        self._order: tuple[int, Tensor] | None = None  # (epoch, its order on the store's device)
        self._block: tuple[int, int, list[Tensor]] | None = None  # (epoch, first position, its batches)
        self._loader = None
        if not isinstance(self.store, Tensor):
            from torch.utils.data import DataLoader

            self._loader = DataLoader(
                self.store,
                batch_sampler=self.shards,
                num_workers=data.workers,
                pin_memory=self.device.type == "cuda",
                persistent_workers=data.workers > 0,
            )

    def _raw(self) -> Tensor:
        epoch, pos = self._cursor
        if self._loader is None:
            block = self._block
            if block is None or block[0] != epoch or not block[1] <= pos < block[1] + len(block[2]):
                block = self._block = (epoch, pos, self._gather(epoch, pos))
            return block[2][pos - block[1]]
        if self._iter is None:
            self.shards.start = (epoch, pos)
            self._iter = iter(self._loader)
        return next(self._iter).to(self.device, non_blocking=True)

    def _gather(self, epoch: int, pos: int) -> list[Tensor]:
        """This rank's batches of ``epoch`` from ``pos`` on, as many as BLOCK_BYTES hold (one at
        least, none past the epoch), indexed at once: each the rows ``order[span(p)]`` of the store."""
        if self._order is None or self._order[0] != epoch:  # copied to the device once an epoch, not per batch
            order = self.shards.order(epoch)
            if self.store.device.type == "cuda":  # through pinned memory: the copy does not wait for the GPU
                order = order.pin_memory().to(self.store.device, non_blocking=True)
            self._order = (epoch, order.to(self.store.device))
        shards, steps = self.shards, self.steps_per_epoch
        per_rank = shards.batch_size // shards.world_size
        batch_bytes = per_rank * self.store[0].numel() * self.store.element_size()
        count = max(1, min(steps - pos, BLOCK_BYTES // max(1, batch_bytes)))
        spans = self._order[1][: steps * shards.batch_size].view(steps, shards.world_size, per_rank)
        return list(self.store[spans[pos : pos + count, shards.rank].reshape(-1)].split(per_rank))

    def _draw(self) -> tuple[Tensor, tuple[int, int]]:
        """The batch at the cursor, prepared and augmented, and the position after it; advances the cursor."""
        if self._cursor[1] >= self.steps_per_epoch:
            self._cursor, self._iter = (self._cursor[0] + 1, 0), None
        epoch, pos = self._cursor
        batch = self._raw()
        if batch.device != self.device:
            batch = batch.to(self.device, non_blocking=True)
        if self.data.prepare is not None:
            batch = self.data.prepare(batch)
        batch = batch.to(self.dtype)
        if self.use_augment and self.data.augment is not None:
            generator = torch.Generator(device=self.device).manual_seed(
                hash((self.seed, epoch, pos, self.rank)) % 2**63
            )
            batch = self.data.augment(batch, generator)
        self._cursor = (epoch, pos + 1)
        return batch, self._cursor

    def example(self) -> Tensor:
        """A batch of zeros shaped and typed as ``next``'s (to trace a step on), drawing nothing."""
        per_rank = self.shards.batch_size // self.shards.world_size
        return torch.zeros(per_rank, *self.data.event_shape, dtype=self.dtype, device=self.device)

    def next(self) -> Tensor:
        """The next batch of this rank: (B/W, *event_shape), on the device, in the run's dtype (the
        one ``prefetch`` prepared, if it did)."""
        if self._ahead is None:
            self._ahead = self._draw()
        batch, (self.epoch, self.pos) = self._ahead
        self._ahead = None
        return batch

    def prefetch(self) -> None:
        """Prepare the batch ``next`` returns next, now: read (from DataLoader workers, into pinned
        memory), copied to the device without blocking, prepared and augmented, while the device
        still works on the step just launched. The position ``state_dict`` reports stays that of the
        batches ``next`` has returned; the batch is the one ``next`` would have made."""
        if self._ahead is None:
            self._ahead = self._draw()

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.pos, self._iter = int(state["epoch"]), int(state["pos"]), None
        self._cursor, self._ahead = (self.epoch, self.pos), None


# ---- image transforms (data-set options) -------------------------------------------------------


@attrs.frozen
class ImageOptions:
    """Options of image data sets (subclass it in a data set's config)."""

    scale: Literal["unit", "symmetric"] = option("unit", "pixel values in [0, 1] ('unit') or [-1, 1] ('symmetric')")
    dequantize: bool = option(False, "add uniform noise before scaling during training: (x + u)/256, u ~ U[0, 1)")
    flip: bool = option(False, "random horizontal flips during training")
    workers: int = option(
        0, "DataLoader worker processes for data read from files (0: in the main process)", non_negative
    )


def image_pipeline(options: ImageOptions) -> tuple[Any, Any]:
    """(prepare, augment) for uint8 images (B, C, H, W) under ``options``.

    prepare: x/255 (or, with dequantisation, x/256 + 1/512 so that the mean of the noisy value
    is kept), then [-1, 1] if symmetric. augment: the dequantisation noise u/256 and flips.
    """
    dequantize = options.dequantize
    low, span = (0.0, 1.0) if options.scale == "unit" else (-1.0, 2.0)

    def prepare(x: Tensor) -> Tensor:
        if x.dtype != torch.uint8:
            return x
        unit = x.float() / 255.0 if not dequantize else (x.float() + 0.5) / 256.0
        return low + span * unit

    def augment(x: Tensor, generator: torch.Generator) -> Tensor:
        if dequantize:
            u = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype)
            x = x + span * (u - 0.5) / 256.0
        if options.flip:
            flip = torch.rand(x.shape[0], generator=generator, device=x.device) < 0.5
            x = torch.where(flip.view(-1, *[1] * (x.dim() - 1)), x.flip(-1), x)
        return x

    return prepare, augment
