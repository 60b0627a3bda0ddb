"""The soak's bit flipper (threefs/testing/chunk_files.random_committed_byte) finds committed chunk bytes on
the default engine (v2 since it became the default, the soak had flipped nothing: it only knew v1's
per-chunk files), and a byte flipped there is caught: reads return the written bytes."""

from __future__ import annotations

import random
from pathlib import Path

from threefs.client.client import Client
from threefs.testing.chunk_files import random_committed_byte


def test_flipped_committed_byte_is_found_and_never_returned(private_cluster):
    cluster = private_cluster(3, 3)
    data = bytes([0x5A]) * (3 << 20)  # every committed byte of this file is 0x5A
    with Client.connect(str(cluster.client_config_path)) as fs:
        fs.write_bytes("/f", data)
        ours = fs.stat("/f").inode.to_bytes(8, "big").hex()  # chunk id: tenant, reserved, inode (BE), ...
        rng = random.Random(20261201)
        flipped = 0
        for _ in range(200):  # other files' chunks (the cluster's own) are found too: skip those
            found = random_committed_byte(Path(cluster.dir, "data"), rng)
            assert found is not None
            path, pos, what = found
            if what.split()[1][4:20] != ours:
                continue
            flipped += 1
            if flipped > 2:  # two flips: every chunk keeps an undamaged replica (R = 3)
                break
            with open(path, "r+b") as f:
                f.seek(pos)
                assert f.read(1) == b"\x5a", what  # a committed byte of our file, not a free block
                f.seek(pos)
                f.write(b"\xa5")
        assert flipped > 2
        assert fs.read_bytes("/f") == data  # each damaged replica fails its checksum: another one serves
