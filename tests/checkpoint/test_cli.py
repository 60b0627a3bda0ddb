"""`threefs ckpt ls / inspect / verify / rm` against a real cluster (the CLI in a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from threefs.checkpoint import CheckpointManager


def _ckpt(cluster, *args):
    return subprocess.run([sys.executable, "-m", "threefs.cli.main", "--config", str(cluster.client_config_path),
                           "ckpt", *args], capture_output=True, text=True, timeout=120)


def test_ckpt_cli(fs, d, cluster):
    root = f"{d}/run"
    m = CheckpointManager(fs, root)
    m.save({"model": {"w": torch.ones(4, 4, dtype=torch.bfloat16), "b": torch.zeros(4)}, "epoch": 2}, step=10,
           user_meta={"note": "first"})
    m.save({"model": {"w": torch.ones(4, 4)}}, step=20)
    fs.mkdir(f"{root}/.partial-step-0000000030-deadbeef")

    r = _ckpt(cluster, "ls", root, "--all")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[0] == "10" and lines[1].split()[0] == "20" and "partial" in lines[2]
    r = _ckpt(cluster, "inspect", root, "--step", "10")
    assert r.returncode == 0, r.stderr
    assert "model.w  bfloat16  [4, 4]  32 B" in r.stdout and "meta note = first" in r.stdout
    assert "plain values: epoch" in r.stdout
    r = _ckpt(cluster, "inspect", f"{root}/step-0000000010", "--json", "--prefix", "model.b")
    info = json.loads(r.stdout)
    assert [t["name"] for t in info["tensors"]] == ["model.b"] and info["tensors"][0]["dtype"] == "float32"

    r = _ckpt(cluster, "verify", root)
    assert r.returncode == 0 and "every tensor matches" in r.stdout, r.stderr
    e = next(t for t in m.index(10).ranks[0].tensors if t.name == "model.b")
    fs.batch_write([(f"{m.path_of(10)}/{e.file}", e.offset, b"\x01")])
    r = _ckpt(cluster, "verify", root, "--step", "10")
    assert r.returncode == 1 and "DAMAGED rank 0 model.b" in r.stderr, r.stderr

    r = _ckpt(cluster, "rm", root)
    assert r.returncode == 2 and "--step N" in r.stderr
    r = _ckpt(cluster, "rm", root, "--step", "10", "--partial")
    assert r.returncode == 0, r.stderr
    assert m.steps() == [20] and m.partial() == []
    r = _ckpt(cluster, "inspect", root, "--step", "10")
    assert r.returncode == 1 and "NOT_FOUND" in r.stderr
    r = _ckpt(cluster, "ls", f"{d}/nothing")
    assert r.returncode == 0 and "no checkpoints" in r.stdout
