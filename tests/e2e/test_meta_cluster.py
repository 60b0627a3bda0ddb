"""Meta over real RPC, on the shared cluster: the POSIX operations the client library exposes, operations by
inode (what the FUSE daemon calls), acting as a user, user tokens, statfs."""

from __future__ import annotations

import errno
import os
import time

import pytest

from threefs.client.client import Client
from threefs.common.config import ClientConfig, load_toml
from threefs.common.status import ThreeFSError
from threefs.rpc.schemas import meta as m
from threefs.rpc.schemas import mgmtd as ms

USER = m.UserCred(1000, 1000)


@pytest.fixture
def d(fs, request):
    path = f"/meta_{request.node.name}"
    fs.mkdir(path)
    yield path
    fs.remove_tree(path)


def _errno(fn, *args, **kwargs) -> int:
    try:
        fn(*args, **kwargs)
    except ThreeFSError as e:
        return e.errno
    return 0


def test_posix_operations_over_rpc(fs, d):
    fs.write_bytes(f"{d}/f", b"hello")
    fs.symlink("f", f"{d}/l")
    assert fs.readlink(f"{d}/l") == "f"
    assert fs.stat(f"{d}/l").length == 5 and fs.lstat(f"{d}/l").type == m.SYMLINK
    assert fs.link(f"{d}/f", f"{d}/h").nlink == 2
    assert fs.read_bytes(f"{d}/h") == b"hello"
    assert fs.chmod(f"{d}/f", 0o640).mode == 0o640
    assert fs.chown(f"{d}/f", 1000, 1000).uid == 1000
    touched = fs.utime(f"{d}/f", (10**9, 2 * 10**9))
    assert (touched.atime_ns, touched.mtime_ns) == (10**9, 2 * 10**9)
    results = fs.batch_stat([f"{d}/f", f"{d}/missing", f"{d}/l"], follow=False)
    assert results[0].type == m.FILE and results[1].errno == errno.ENOENT and results[2].type == m.SYMLINK
    assert _errno(fs.link, d, f"{d}/x") == errno.EPERM
    assert _errno(fs.readlink, f"{d}/f") == errno.EINVAL
    fs.mkdir(f"{d}/tree/a/b", parents=True)
    fs.write_bytes(f"{d}/tree/a/b/x", b"x" * 1000)
    fs.remove_tree(f"{d}/tree")
    assert not fs.exists(f"{d}/tree")


def test_inode_operations_for_fuse(fs, d):
    aio, run = fs.aio, fs.run
    parent = fs.stat(d).inode
    rsp = run(aio.create_at(parent, "f", os.O_WRONLY, 0o600))
    assert rsp.session and rsp.attr.mode == 0o600
    run(aio.write_at(rsp.attr, 0, b"abc"))
    attr = run(aio.sync_file(rsp.attr.inode, rsp.session, 3, rsp.attr.truncate_ver))
    assert attr.length == 3
    run(aio.close_file(rsp.attr.inode, rsp.session, 3))
    assert run(aio.lookup(parent, "f")).inode == rsp.attr.inode
    assert run(aio.getattr(rsp.attr.inode)).length == 3
    assert [p.inode for p in rsp.parents] == [parent]  # what the create committed of the directory
    made = run(aio.mkdir_at(parent, "sub"))
    sub = made.attr
    assert made.parents == [fs.stat(d)] and made.parents[0].nlink == 3  # over the wire, as committed
    assert run(aio.link_at(rsp.attr.inode, sub.inode, "g")).parents == [fs.stat(f"{d}/sub")]
    assert run(aio.symlink_at(sub.inode, "l", "g")).parents == [fs.stat(f"{d}/sub")]
    page = run(aio.readdir(parent=sub.inode))
    assert [e.name for e in page.entries] == ["g", "l"] and not page.more
    assert run(aio.readlink(parent=run(aio.lookup(sub.inode, "l")).inode)) == "g"
    moved = run(aio.rename_at(sub.inode, "g", parent, "g2"))
    assert sorted(moved.parents, key=lambda a: a.inode) == sorted([fs.stat(d), fs.stat(f"{d}/sub")],
                                                                   key=lambda a: a.inode)
    assert run(aio.setattr(parent=rsp.attr.inode, length=1)).length == 1
    assert run(aio.unlink_at(parent, "g2")).parents == [fs.stat(d)]
    run(aio.unlink_at(sub.inode, "l"))
    gone = run(aio.rmdir_at(parent, "sub"))
    assert gone.parents == [fs.stat(d)] and gone.parents[0].nlink == 2
    opened = run(aio.open_inode(rsp.attr.inode, os.O_RDONLY))
    assert opened.attr.length == 1 and not opened.session


def test_the_cluster_token_acts_as_any_user(fs, d):
    aio, run = fs.aio, fs.run
    fs.mkdir(f"{d}/closed", 0o700)
    parent = fs.stat(d).inode
    with pytest.raises(PermissionError):
        run(aio.lookup(fs.stat(f"{d}/closed").inode, "x", user=USER))  # no search permission
    fs.chmod(d, 0o777)
    made = run(aio.mkdir_at(parent, "mine", 0o755, user=USER)).attr
    assert (made.uid, made.gid) == (1000, 1000)
    with pytest.raises(PermissionError):
        run(aio.setattr(f"{d}/closed", mode=0o777, user=USER))  # not the owner: EPERM


def test_statfs_reports_capacity(fs):
    st = fs.statfs()
    assert st.targets > 0 and st.replicas == 3
    assert st.capacity_bytes == st.used_bytes + st.free_bytes
    vfs = os.statvfs("/tmp")  # the test cluster's targets live on this machine's disk
    deadline = time.monotonic() + 20
    while st.targets_reporting < st.targets and time.monotonic() < deadline:
        time.sleep(0.5)
        st = fs.statfs()
    assert st.targets_reporting == st.targets
    assert 0 < st.free_bytes * st.replicas <= vfs.f_blocks * vfs.f_frsize


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except ThreeFSError:
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_user_tokens_act_as_their_uid(fs, cluster, d):
    """A token issued by mgmtd for user alice (uid 1001) creates files as 1001 and may not act as root."""
    name = f"u{os.getpid() % 100000}"
    rsp = fs.run(fs.aio.mgmtd.call("user_add", ms.UserReq(name, 1001, 1001), ms.UserTokenRsp))
    fs.chmod(d, 0o777)
    base = load_toml(cluster.client_config_path, ClientConfig)
    config = ClientConfig(mgmtd=base.mgmtd, token=rsp.token, cluster_dir=base.cluster_dir)

    def connect_and_create():  # meta learns new tokens within a routing refresh
        with Client(config) as user_fs:
            user_fs.write_bytes(f"{d}/by_user", b"u")
            user_fs.aio.acting_user = m.UserCred(0, 0)  # only privileged tokens may pass a user
            return _errno(user_fs.stat, d)

    assert _wait(connect_and_create, 30, "meta to accept the new user token") == errno.EACCES
    assert (fs.stat(f"{d}/by_user").uid, fs.stat(f"{d}/by_user").gid) == (1001, 1001)


def test_two_clients_race_through_two_meta_servers(fs, cluster, d):
    """Two clients (own connections, calls spread over both meta servers) race: exclusive creates and
    no-replace renames of one name have exactly one winner, and nothing is lost; concurrent creates in
    one directory all appear."""
    from concurrent.futures import ThreadPoolExecutor

    with Client.connect(str(cluster.client_config_path)) as other:
        clients = [fs, other]

        def create_excl(k, name):
            try:
                touch(k, name, exclusive=True)
                return k
            except FileExistsError:
                return None

        def touch(k, name, exclusive=False):
            aio = clients[k].aio
            flags = os.O_CREAT | os.O_WRONLY | (os.O_EXCL if exclusive else 0)
            rsp = clients[k].run(aio.open(name, flags))
            clients[k].run(aio.close_file(rsp.attr.inode, rsp.session, -1))

        def rename_noreplace(k, src, dst):
            try:
                clients[k].rename(src, dst, noreplace=True)
                return k
            except FileExistsError:
                return None

        with ThreadPoolExecutor(2) as pool:
            for i in range(10):
                winners = list(pool.map(create_excl, [0, 1], [f"{d}/x{i}"] * 2))
                assert sorted(w for w in winners if w is not None) in ([0], [1])
                touch(0, f"{d}/a{i}")
                touch(1, f"{d}/b{i}")
                won = list(pool.map(rename_noreplace, [0, 1], [f"{d}/a{i}", f"{d}/b{i}"], [f"{d}/y{i}"] * 2))
                assert [w for w in won if w is not None] in ([0], [1])
                loser = f"{d}/b{i}" if won[0] == 0 else f"{d}/a{i}"
                assert fs.exists(loser) and fs.exists(f"{d}/y{i}")  # nothing lost
            names = [(k, f"{d}/c{k}-{j}") for k in range(2) for j in range(40)]
            list(pool.map(lambda item: touch(*item), names))
        listed = set(fs.listdir(d))
        assert {p.rsplit("/", 1)[1] for _, p in names} <= listed
