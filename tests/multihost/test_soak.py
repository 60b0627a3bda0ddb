"""The soak harness itself (threefs/testing/soak.py), run short: a minute of mixed workload on netns
hosts with a fault every 8-15 s (kill -9 of storage/meta/mgmtd, a cut link, a flipped chunk byte).
The 30-minute run is `python -m threefs.testing.soak --minutes 30` (docs/operations.md)."""

from __future__ import annotations

import pytest

from threefs.testing.netns import netns_unavailable
from threefs.testing.soak import Soak, ok

pytestmark = pytest.mark.skipif(netns_unavailable() is not None, reason=str(netns_unavailable()))


def test_a_short_soak_loses_nothing(tmp_path):
    soak = Soak(tmp_path, storage=4, seed=20261201, fault_every=(8.0, 15.0))
    try:
        soak.start()
        result = soak.run(minutes=1.0)
    finally:
        soak.close()
    assert sum(result["faults"].values()) >= 3, result["faults"]
    assert sum(result["ops"].values()) > 100 and result["checked"] > 10, result
    assert ok(result), {k: result[k] for k in ("worker_exit", "acked_bytes_lost", "lost", "corrupt_reads",
                                               "namespace_wrong", "checkpoint_problems")}
