"""Faults on the local executor: a worker killed mid-task (the task runs again, the job completes), a failed
job rerun with the same job id (completed tasks are not run again), and init() argument precedence."""

from __future__ import annotations

import os
import signal
from datetime import datetime

import pyarrow as pa
import pytest

import threefs.pond as pond

from pond_helpers import multiset, reference


def _count_runs(marks: str) -> int:
    return len(os.listdir(marks)) if os.path.isdir(marks) else 0


def test_killed_executor_is_retried(data_dir, tmp_path):
    sp = pond.init(data_root=str(tmp_path / "root"), num_cpus=2, progress=False)
    flag = tmp_path / "killed-once"

    def die_once(t: pa.Table) -> pa.Table:
        if not flag.exists():
            flag.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)  # the worker process dies mid-task
        return t

    try:
        df = sp.read_parquet(f"{data_dir}/*.parquet").repartition(4).map_batches(die_once)
        assert multiset(df.take_all()) == reference(data_dir, "select * from {0}")
        assert flag.exists()
        assert any(r.status == "lost" for r in sp._scheduler.stats.records)
    finally:
        sp.shutdown()


def test_failed_job_resumes_from_completed_tasks(data_dir, tmp_path):
    root, marks, poison = str(tmp_path / "root"), tmp_path / "runs", tmp_path / "poison"
    marks.mkdir()
    poison.write_text("partition 3 fails while this file exists")
    job = dict(job_id="resume-job", job_time=datetime(2026, 1, 2, 3, 4, 5), data_root=root, num_cpus=2,
               progress=False)

    def pipeline(sp):
        def work(runtime_ctx, tables):
            t = tables[0]
            part = runtime_ctx.task.partition_index
            (marks / f"{part}-{os.getpid()}-{len(os.listdir(marks))}").write_text("")
            if part == 3 and poison.exists():
                raise RuntimeError("poisoned partition")
            return t
        from threefs.pond.logical.node import ArrowComputeNode
        src = sp.read_parquet(f"{data_dir}/*.parquet").repartition(4)
        return pond.DataFrame(sp, ArrowComputeNode(sp._ctx, (src.plan,), process_func=work))

    sp = pond.init(**job)
    with pytest.raises(pond.TaskFailedError, match="poisoned partition"):
        pipeline(sp).compute()
    sp.shutdown()
    assert "failure" in open(sp._runtime_ctx.job_status_path).read()
    first = _count_runs(marks)
    assert first == 5  # 3 good partitions + 2 attempts of the poisoned one; running tasks were let finish
    # outputs appear atomically: the finished partitions are in output/, the failed one only in staging/
    rc = sp._runtime_ctx
    node_dirs = [d for d in os.listdir(rc.output_root) if d.startswith("ArrowComputeTask.")]
    assert len(node_dirs) == 1
    done = sorted(os.listdir(os.path.join(rc.output_root, node_dirs[0])))
    assert done == [f"resume-job.{i:06d}" for i in (0, 1, 2)], done
    assert any(n.startswith("ArrowComputeTask-") and ".000003." in n for n in os.listdir(rc.staging_root))

    poison.unlink()
    sp = pond.init(**job)  # same job id, time and root: the completed partitions are skipped
    try:
        out = pipeline(sp)
        assert multiset(out.take_all()) == reference(data_dir, "select * from {0}")
        assert _count_runs(marks) == first + 1  # only partition 3 ran again
        assert sp._scheduler.stats.resumed == 3
    finally:
        sp.shutdown()


def test_explicit_init_arguments_win_over_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SP_JOBID", "from-env")
    monkeypatch.setenv("SP_DATA_ROOT", str(tmp_path / "env-root"))
    sp = pond.init(job_id="explicit", progress=False)
    try:
        assert sp._runtime_ctx.job_id == "explicit"           # the argument wins (smallpond: the env wins)
        assert sp._runtime_ctx.data_root == str(tmp_path / "env-root")  # the env fills in what is left out
    finally:
        sp.shutdown()
    monkeypatch.setenv("SP_NUM_EXECUTORS", "two")
    with pytest.raises(pond.PondError, match="SP_NUM_EXECUTORS='two' is not a valid int"):
        pond.init(progress=False)


def test_shutdown_removes_temporaries_only_on_success(tmp_path):
    sp = pond.init(data_root=str(tmp_path / "ok"), num_cpus=1, progress=False)
    sp.from_items([1, 2, 3]).map("item * 2 as x").write_parquet(str(tmp_path / "out"))
    rc = sp._runtime_ctx
    sp.shutdown()
    assert not os.path.exists(rc.staging_root) and not os.path.exists(rc.queue_root)
    assert sorted(os.listdir(tmp_path / "out"))[0] == ".MANIFEST.txt"
    assert pa.parquet.read_table(str(tmp_path / "out")).num_rows == 3  # the hard links outlive the job


def test_timeline_and_progress(data_dir, tmp_path, capsys):
    sp = pond.init(data_root=str(tmp_path / "root"), num_cpus=2, progress=True)
    try:
        df = sp.read_parquet(f"{data_dir}/*.parquet").repartition(3, hash_by="k")
        sp.partial_sql("select k, count(*) from {0} group by k", df).compute()
        html = open(sp.dump_timeline(str(tmp_path / "t.html"))).read()
        executed = sp._scheduler.stats.executed
        assert executed >= 4 and html.count('class="bar"') == executed  # one bar per task attempt
        assert "pond tasks" in capsys.readouterr().err  # the progress bar
    finally:
        sp.shutdown()


def test_a_smallpond_script_without_main_guard_runs(data_dir, tmp_path):
    """Workers must not re-run the user's script (multiprocessing re-imports __main__ in forkserver
    children; smallpond scripts have no `if __name__ == "__main__"` guard)."""
    import subprocess
    import sys
    script = tmp_path / "job.py"
    script.write_text(
        "import threefs.pond as smallpond\n"
        f"sp = smallpond.init(data_root={str(tmp_path / 'root')!r}, num_cpus=2, progress=False)\n"
        f"df = sp.read_parquet({data_dir + '/*.parquet'!r}).repartition(3, hash_by='k')\n"
        "df = sp.partial_sql('select k, count(*) as n from {0} group by k', df)\n"
        f"df.write_parquet({str(tmp_path / 'out')!r})\n"
        "print('rows', len(df.to_pandas()))\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("rows 50") == 1, proc.stdout  # printed once: the script ran once
