"""PyTorch side: a map-style Dataset that fetches a whole batch in one call, and a resumable loader.

    ds = FFRecordDataset("/data/train", client=fs)          # override process() to decode samples
    loader = DataLoader(ds, batch_size=64, shuffle=True, seed=0, num_workers=2, collate_fn=my_collate)
    loader.load_state_dict(saved)                            # {"epoch": e, "step": s}: resume mid-epoch
    for batch in loader: ...                                 # epochs advance by themselves
    saved = loader.state_dict()

`FFRecordDataset.__getitems__(indices)` is what torch's fetcher calls per batch (torch >= 2.1), so
a batch is one `FileReader.read` = one `batch_read`: random access straight from storage, no
shuffle buffer and no read-ahead of samples. Workers: with fork (the default) the reader's Client
reconnects in the child by itself; with spawn the dataset pickles to (config, paths, check_data)
and reopens in the worker.
"""

from __future__ import annotations

import numpy as np
import torch.utils.data as tud

from threefs.common.status import StatusCode, status_error
from threefs.ffrecord.reader import FileReader


class FFRecordDataset(tud.Dataset):
    """Samples of FFRecord files by global index. `process(indices, samples)` turns a batch of raw
    uint8 arrays into what the collate function gets (a list, one item per index); the default
    returns the arrays."""

    def __init__(self, fnames, check_data: bool = True, *, client=None):
        self.reader = FileReader(fnames, check_data, client=client)

    def __len__(self) -> int:
        return self.reader.n

    def process(self, indices: list[int], samples: list[np.ndarray]) -> list:
        return samples

    def __getitems__(self, indices) -> list:
        indices = list(indices)
        return self.process(indices, self.reader.read(indices))

    def __getitem__(self, index):
        if isinstance(index, (list, tuple, np.ndarray)):  # the reference's batch indexing
            return self.__getitems__(index)
        return self.__getitems__([index])[0]


class ResumableBatchSampler(tud.Sampler):
    """Batches of indices: a seeded permutation per epoch (or 0..n-1), split over `world_size`
    ranks, that can start at any step of an epoch. After a full pass the epoch advances."""

    def __init__(self, n: int, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, rank: int = 0, world_size: int = 1):
        if batch_size < 1 or n < 0 or not 0 <= rank < world_size:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"bad sampler arguments: n={n}, "
                               f"batch_size={batch_size}, rank={rank}, world_size={world_size}")
        self.n, self.batch_size, self.shuffle, self.seed = n, batch_size, shuffle, seed
        self.drop_last, self.rank, self.world_size = drop_last, rank, world_size
        self.epoch, self.step = 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.step = int(epoch), 0

    def set_step(self, step: int) -> None:
        """The next pass starts at batch `step` of the current epoch (skips without reading)."""
        if not 0 <= step <= self.batches_per_epoch():
            raise status_error(StatusCode.INVALID_ARGUMENT, f"step {step} outside the epoch's "
                               f"{self.batches_per_epoch()} batches")
        self.step = int(step)

    def _indices(self) -> np.ndarray:
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n)
        else:
            order = np.arange(self.n)
        return order[self.rank::self.world_size]

    def batches_per_epoch(self) -> int:
        mine = len(range(self.rank, self.n, self.world_size))
        return mine // self.batch_size if self.drop_last else -(-mine // self.batch_size)

    def __len__(self) -> int:
        return self.batches_per_epoch() - self.step

    def __iter__(self):
        order, bs = self._indices(), self.batch_size
        for b in range(self.step, self.batches_per_epoch()):
            yield order[b * bs:(b + 1) * bs].tolist()
        self.epoch, self.step = self.epoch + 1, 0


class DataLoader(tud.DataLoader):
    """torch's DataLoader over a ResumableBatchSampler, counting the batches handed out so that
    `state_dict()` says where to resume (batches in flight in workers are not counted)."""

    def __init__(self, dataset, batch_size: int = 1, shuffle: bool = False, *, seed: int = 0,
                 drop_last: bool = False, rank: int = 0, world_size: int = 1, **kwargs):
        for name in ("sampler", "batch_sampler"):
            if kwargs.get(name) is not None:
                raise status_error(StatusCode.INVALID_ARGUMENT, f"{name}= is not supported: this loader "
                                   "owns its ResumableBatchSampler (use torch's DataLoader for custom ones)")
        sampler = ResumableBatchSampler(len(dataset), batch_size, shuffle=shuffle, seed=seed,
                                        drop_last=drop_last, rank=rank, world_size=world_size)
        super().__init__(dataset, batch_sampler=sampler, **kwargs)
        self._position = (0, 0)  # (epoch, batches consumed in it)

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)
        self._position = (int(epoch), 0)

    def set_step(self, step: int) -> None:
        self.batch_sampler.set_step(step)
        self._position = (self.batch_sampler.epoch, int(step))

    def state_dict(self) -> dict:
        epoch, step = self._position
        return {"epoch": epoch, "step": step}

    def load_state_dict(self, state: dict) -> None:
        self.set_epoch(state["epoch"])
        self.set_step(state["step"])

    def __iter__(self):
        sampler = self.batch_sampler
        epoch, step = sampler.epoch, sampler.step
        self._position = (epoch, step)
        try:
            for batch in super().__iter__():
                step += 1
                self._position = (epoch, step)
                yield batch
            self._position = (epoch + 1, 0)
        finally:  # a loop left early resumes where it stopped at the next pass
            sampler.epoch, sampler.step = self._position
