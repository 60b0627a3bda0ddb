"""PyTorch: batches in one call, 2 forked workers see every index once per epoch, resume mid-epoch,
a dataset pickled into spawned workers."""

from __future__ import annotations

import pickle
import struct

import pytest

from threefs.common.status import ThreeFSError
from threefs.ffrecord import FileWriter
from threefs.ffrecord.dump import dump
from threefs.ffrecord.torch import DataLoader, FFRecordDataset, ResumableBatchSampler

N = 203  # not a multiple of the batch size: the last batch is short


class Indexed(FFRecordDataset):
    """Samples carry their own index: decode it, and check the payload."""

    def process(self, indices, samples):
        out = []
        for i, s in zip(indices, samples):
            (k,) = struct.unpack_from("<q", s)
            assert k == i and len(s) == 8 + k % 97
            out.append(k)
        return out


def collate(batch):
    return list(batch)


def sample(i: int) -> bytes:
    return struct.pack("<q", i) + bytes([i % 251]) * (i % 97)


@pytest.fixture
def dataset_dir(fs, d):
    dump([sample(i) for i in range(N)], f"{d}/ds", 3, client=fs)
    return f"{d}/ds"


def test_getitems_fetches_a_batch(fs, dataset_dir):
    ds = Indexed(dataset_dir, client=fs)
    assert len(ds) == N
    assert ds.__getitems__([5, 200, 70]) == [5, 200, 70]
    assert ds[17] == 17 and ds[[1, 2]] == [1, 2]


def epoch(loader) -> list[int]:
    return [k for batch in loader for k in batch]


def test_two_fork_workers_every_index_once_and_resume(fs, dataset_dir):
    ds = Indexed(dataset_dir, client=fs)
    loader = DataLoader(ds, batch_size=16, shuffle=True, seed=11, num_workers=2, collate_fn=collate)
    assert len(loader) == 13
    first = epoch(loader)
    assert sorted(first) == list(range(N)) and first != list(range(N))
    assert loader.state_dict() == {"epoch": 1, "step": 0}
    second = epoch(loader)
    assert sorted(second) == list(range(N)) and second != first  # a new permutation per epoch

    # stop after 5 batches of epoch 2, resume in a new loader (a restarted job) from the state
    loader.set_epoch(2)
    seen = []
    for step, batch in enumerate(loader):
        seen += batch
        if step == 4:
            break
    state = loader.state_dict()
    assert state == {"epoch": 2, "step": 5}
    resumed = DataLoader(ds, batch_size=16, shuffle=True, seed=11, num_workers=2, collate_fn=collate)
    resumed.load_state_dict(state)
    assert len(resumed) == 13 - 5
    rest = epoch(resumed)
    assert sorted(seen + rest) == list(range(N))
    reference = DataLoader(ds, batch_size=16, shuffle=True, seed=11, collate_fn=collate)
    reference.set_epoch(2)
    assert seen + rest == epoch(reference)  # the very order an uninterrupted epoch has
    # the first loader, left mid-epoch, also goes on where it stopped
    assert seen + epoch(loader) == seen + rest


def _spawn_worker_init(worker_id):
    import torch.utils.data

    info = torch.utils.data.get_worker_info()
    assert info.dataset.reader._files.client is not None


def test_spawned_workers_get_a_pickled_dataset(fs, dataset_dir):
    ds = Indexed(dataset_dir, client=fs)
    clone = pickle.loads(pickle.dumps(ds))
    assert clone.__getitems__([3, 4]) == [3, 4]
    loader = DataLoader(ds, batch_size=50, num_workers=2, multiprocessing_context="spawn",
                        collate_fn=collate, worker_init_fn=_spawn_worker_init)
    assert epoch(loader) == list(range(N))


def test_sampler_ranks_partition_and_bad_arguments():
    parts = [ResumableBatchSampler(10, 3, seed=1, rank=r, world_size=3) for r in range(3)]
    seen = sorted(i for s in parts for b in s for i in b)
    assert seen == list(range(10))
    s = ResumableBatchSampler(10, 3, shuffle=False, drop_last=True)
    assert list(s) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    with pytest.raises(ThreeFSError, match="step 9 outside"):
        s.set_step(9)
    with pytest.raises(ThreeFSError, match="bad sampler arguments"):
        ResumableBatchSampler(10, 0)
    with pytest.raises(ThreeFSError, match="sampler= is not supported"):
        DataLoader([], sampler=[0])


def test_local_files_work_too(tmp_path):
    with FileWriter(tmp_path / "l.ffr", 4) as w:
        for i in range(4):
            w.write_one(sample(i))
    loader = DataLoader(Indexed(tmp_path / "l.ffr"), batch_size=3, num_workers=2, collate_fn=collate)
    assert epoch(loader) == [0, 1, 2, 3]
