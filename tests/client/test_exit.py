"""A process's exit with clients left open or dropped: every client loop thread is stopped before the
interpreter finalises (a daemon thread still inside uvloop then could crash the exit: SIGSEGV)."""

from __future__ import annotations

import subprocess
import sys

CHILD = r"""
import atexit, gc, sys, threading

def report():  # registered first, so it runs after threefs's own exit handlers (atexit is last in, first out)
    alive = [t.name for t in threading.enumerate() if t.name == "threefs-client" and t.is_alive()]
    print("alive at exit:", alive, flush=True)

atexit.register(report)
from threefs.client.client import Client
kept = Client.connect(sys.argv[1])  # open at exit
kept.stat("/")
for _ in range(3):  # dropped without close(): only the loop thread itself still refers to its loop
    c = Client.connect(sys.argv[1])
    c.stat("/")
    del c
gc.collect()
print("alive before exit:", sum(t.name == "threefs-client" for t in threading.enumerate()), flush=True)
"""


def test_loop_threads_of_open_and_dropped_clients_are_stopped_at_exit(cluster):
    out = subprocess.run([sys.executable, "-c", CHILD, str(cluster.client_config_path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "alive before exit: 4" in out.stdout, out.stdout  # the dropped clients' threads were still running
    assert "alive at exit: []" in out.stdout, out.stdout
