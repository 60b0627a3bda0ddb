"""The FUSE daemon handles its signals from the moment its mount is visible.

spawn() (and scripts) take a visible mount for a serving daemon; a signal whose handler was not in yet
took its default action there: a SIGUSR1 (log the counters) sent at once after the mount appeared killed
the daemon in a CI run (tests/fuse/test_fuse_changed_dirs.py, returncode -10)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from fuse_helpers import require_fuse, stop_daemon

from threefs.client import fuse_mount


def _caught(pid: int) -> int:
    """The signals process `pid` has handlers for (/proc/PID/status SigCgt, bit n-1 for signal n)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("SigCgt:"):
                return int(line.split()[1], 16)
    raise AssertionError(f"no SigCgt line for pid {pid}")


def test_signals_are_handled_as_soon_as_the_mount_is_visible(cluster, tmp_path):
    require_fuse()
    for i in range(3):
        mnt, log = str(tmp_path / f"m{i}"), str(tmp_path / f"daemon{i}.log")
        os.makedirs(mnt)
        with open(log, "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "threefs.cli.main", "--config",
                                     str(cluster.client_config_path), "mount", "--foreground", mnt],
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while not fuse_mount.is_threefs_mount(mnt):  # poll as tightly as we can: the first sight counts
                assert proc.poll() is None, f"the daemon exited ({proc.returncode}); see {log}"
                assert time.monotonic() < deadline, f"no mount within 60 s; see {log}"
            caught = _caught(proc.pid)
            for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
                assert caught & (1 << (sig - 1)), f"{sig.name} has no handler when the mount appears"
            os.kill(proc.pid, signal.SIGUSR1)  # at once: the daemon logs its counters and goes on serving
            while not any("requests served" in x for x in open(log)):
                assert proc.poll() is None, f"SIGUSR1 killed the daemon ({proc.returncode}); see {log}"
                assert time.monotonic() < deadline, f"no statistics line within 60 s; see {log}"
                time.sleep(0.05)
            assert os.listdir(mnt) is not None and proc.poll() is None
        finally:
            stop_daemon(proc, mnt)
