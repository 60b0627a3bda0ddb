"""`threefs` file commands, in process: recursive put/get, ls -l, du, df, rm -r, mv, exit codes."""

from __future__ import annotations

import os
import time

import pytest

from threefs.cli.main import main


@pytest.fixture
def cli(cluster, capsys):
    def run(*argv):
        code = main(["--config", str(cluster.client_config_path), *argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def _tree(root, rng):
    files = {}
    for rel, size in (("a.bin", 3 * (1 << 20) + 5), ("sub/b.txt", 10), ("sub/deep/c.bin", 200_000),
                      ("sub/deep/empty", 0), ("z", 1)):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(size))
        files[rel] = path.read_bytes()
    return files


def test_put_get_recursive_round_trip(cli, d, tmp_path, rng):
    src = tmp_path / "src"
    files = _tree(src, rng)
    code, out, _ = cli("put", "-r", str(src), f"{d}/up")
    assert code == 0 and f"{len(files)} files" in out
    code, out, _ = cli("ls", "-l", f"{d}/up/sub")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("-") and lines[0].endswith(" b.txt") and " 10 " in lines[0]
    assert lines[1].startswith("d") and lines[1].endswith(" deep")
    back = tmp_path / "back"
    back.mkdir()
    code, out, _ = cli("get", "-r", f"{d}/up", str(back))
    assert code == 0
    for rel, data in files.items():
        assert (back / "up" / rel).read_bytes() == data, rel
    code, out, _ = cli("du", f"{d}/up")
    assert code == 0 and out.split()[0] == str(sum(len(v) for v in files.values()))


def test_put_many_into_directory_and_cat(cli, d, tmp_path):
    (tmp_path / "one").write_bytes(b"1\n")
    (tmp_path / "two").write_bytes(b"2\n")
    assert cli("mkdir", "-p", f"{d}/x/y")[0] == 0
    assert cli("mkdir", "-p", f"{d}/x/y")[0] == 0  # -p accepts existing
    assert cli("put", "-q", str(tmp_path / "one"), str(tmp_path / "two"), f"{d}/x/y")[0] == 0
    code, out, _ = cli("cat", f"{d}/x/y/one", f"{d}/x/y/two")
    assert (code, out) == (0, "1\n2\n")
    code, out, _ = cli("ls", f"{d}/x/y")
    assert out.split() == ["one", "two"]


def test_rm_mv_stat_and_exit_codes(cli, d, tmp_path):
    (tmp_path / "f").write_bytes(b"data")
    assert cli("put", "-q", str(tmp_path / "f"), f"{d}/f")[0] == 0
    assert cli("mkdir", f"{d}/dir")[0] == 0
    assert cli("mv", f"{d}/f", f"{d}/dir")[0] == 0  # into the directory, like mv
    code, out, _ = cli("stat", f"{d}/dir/f")
    assert code == 0 and '"length": 4' in out and '"type": "file"' in out
    code, _, err = cli("rm", f"{d}/dir")
    assert code == 1 and "use rm -r" in err
    assert cli("rm", "-r", f"{d}/dir")[0] == 0
    code, _, err = cli("ls", f"{d}/dir")
    assert code == 1 and "NOT_FOUND" in err
    assert cli("rm", "-f", f"{d}/dir")[0] == 0
    code, _, err = cli("cat", f"{d}/nope")
    assert code == 1 and "NOT_FOUND" in err
    code, _, err = cli("put", str(tmp_path / "missing"), f"{d}/m")
    assert code == 1 and "missing" in err
    code, _, err = cli("put", str(tmp_path), f"{d}/m")
    assert code == 1 and "use put -r" in err
    code, _, err = cli("get", f"{d}", str(tmp_path / "nowhere" / "x"))
    assert code == 1 and "get -r" in err
    with pytest.raises(SystemExit) as e:
        main(["ls", "--no-such-flag"])
    assert e.value.code == 2


def test_df_reports_used_space(cli, d, tmp_path, rng):
    (tmp_path / "f").write_bytes(rng.randbytes(1 << 20))
    cli("put", "-q", str(tmp_path / "f"), f"{d}/f")
    deadline = time.monotonic() + 30  # storage reports used bytes with its heartbeats (every second)
    while True:
        code, out, _ = cli("df")
        assert code == 0
        header, row = out.splitlines()
        name, size, used, avail, _use, replicas, _targets = row.split()
        if int(used) > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert name == "threefs" and replicas == "3" and int(used) > 0
    assert int(size) == int(used) + int(avail)


def test_progress_bar_only_on_a_terminal(cli, d, tmp_path):
    (tmp_path / "f").write_bytes(os.urandom(1000))
    code, out, err = cli("put", str(tmp_path / "f"), f"{d}/f")
    assert code == 0 and "1 file, 1000 bytes" in out and err == ""
