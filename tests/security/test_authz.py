"""Authorization through real processes: meta enforces POSIX permissions for the user a token names.

The full errno table (every operation x owner/group/other x sticky, against Linux's own answers) is
tests/meta/test_meta_perms.py, run in-process against MetaStore. This file proves the same rules hold
end to end: user tokens issued by mgmtd, the uid/gid meta learns from mgmtd, real meta processes, and
that a user token cannot claim another identity.
"""

from __future__ import annotations

import errno

import pytest

from threefs.common.status import PermissionError_, StatusCode, ThreeFSError
from threefs.rpc.client import RpcClient
from threefs.rpc.schemas import meta as m
from threefs.rpc.schemas import mgmtd as ms


@pytest.fixture(scope="module")
def users(sec):
    root = sec.root
    root.mkdir("/authz", 0o755)
    root.mkdir("/authz/pub", 0o777)
    root.mkdir("/authz/sticky", 0o1777)
    return sec.client_as("alice"), sec.client_as("bob")


def denied(fn, *args, err: int = errno.EACCES) -> None:
    with pytest.raises(PermissionError_) as ei:
        fn(*args)
    assert ei.value.errno == err, ei.value
    assert ei.value.message  # says what was refused


def test_new_entries_belong_to_the_tokens_user(sec, users):
    alice, _ = users
    alice.write_bytes("/authz/pub/owned", b"x")
    attr = sec.root.stat("/authz/pub/owned")
    assert (attr.uid, attr.gid) == (1000, 1000)


def test_write_permission_of_the_directory(sec, users):
    alice, _ = users
    denied(alice.mkdir, "/authz/nope")
    denied(alice.write_bytes, "/authz/nope.txt", b"x")
    assert not sec.root.exists("/authz/nope") and not sec.root.exists("/authz/nope.txt")


def test_read_and_write_permission_of_a_file(sec, users):
    alice, bob = users
    alice.write_bytes("/authz/pub/secret", b"alice only")
    alice.chmod("/authz/pub/secret", 0o600)
    denied(bob.read_bytes, "/authz/pub/secret")
    denied(bob.write_bytes, "/authz/pub/secret", b"bob was here")
    denied(bob.truncate, "/authz/pub/secret", 0)
    alice.chmod("/authz/pub/secret", 0o644)
    assert bob.read_bytes("/authz/pub/secret") == b"alice only"
    denied(bob.write_bytes, "/authz/pub/secret", b"bob was here")
    assert sec.root.read_bytes("/authz/pub/secret") == b"alice only"  # root bypasses, nothing changed


def test_search_and_list_permission_of_a_directory(sec, users):
    alice, bob = users
    alice.mkdir("/authz/pub/private", 0o700)
    alice.write_bytes("/authz/pub/private/f", b"inside")
    denied(bob.stat, "/authz/pub/private/f")
    denied(bob.listdir, "/authz/pub/private")
    denied(bob.read_bytes, "/authz/pub/private/f")
    alice.chmod("/authz/pub/private", 0o711)  # search but not list
    assert bob.read_bytes("/authz/pub/private/f") == b"inside"
    denied(bob.listdir, "/authz/pub/private")


def test_sticky_directory_protects_other_users_entries(sec, users):
    alice, bob = users
    alice.write_bytes("/authz/sticky/alices", b"a")
    sec.root.chmod("/authz/sticky/alices", 0o666)
    denied(bob.remove, "/authz/sticky/alices", err=errno.EPERM)
    denied(bob.rename, "/authz/sticky/alices", "/authz/sticky/bobs-now", err=errno.EPERM)
    assert sec.root.read_bytes("/authz/sticky/alices") == b"a"
    bob.write_bytes("/authz/sticky/alices", b"b")  # writing the file itself is its mode's business
    alice.rename("/authz/sticky/alices", "/authz/sticky/moved")
    alice.remove("/authz/sticky/moved")


def test_chown_only_by_root_and_chmod_only_by_owner(sec, users):
    alice, bob = users
    alice.write_bytes("/authz/pub/mine", b"m")
    denied(alice.chown, "/authz/pub/mine", 2000, None, err=errno.EPERM)
    denied(alice.chown, "/authz/pub/mine", None, 2000, err=errno.EPERM)  # not one of her groups
    denied(bob.chmod, "/authz/pub/mine", 0o777, err=errno.EPERM)
    attr = sec.root.stat("/authz/pub/mine")
    assert (attr.uid, attr.mode & 0o777) == (1000, 0o644)
    sec.root.chown("/authz/pub/mine", 2000, 2000)
    assert bob.stat("/authz/pub/mine").uid == 2000


def test_user_token_cannot_act_as_another_user(sec, users):
    """Only the cluster token may name a user in a request (the FUSE daemon does); a user token that
    names root or someone else is refused, whatever it asks."""
    meta = sec.addrs(ms.META)[0]
    rpc = RpcClient(sec.tokens["alice"])
    try:
        for cred in (m.UserCred(0, 0), m.UserCred(2000, 2000), m.UserCred(1000, 1000, (0,))):
            with pytest.raises(ThreeFSError) as ei:
                sec.root.run(rpc.call(meta, "meta.mkdir", m.MkdirReq("/authz/as-other", user=cred),
                                       m.AttrRsp))
            assert ei.value.code == StatusCode.PERMISSION_DENIED and "may not act as" in ei.value.message
        # naming herself exactly is allowed (and still cannot write /authz)
        with pytest.raises(ThreeFSError) as ei:
            mine = m.MkdirReq("/authz/as-self", user=m.UserCred(1000, 1000))
            sec.root.run(rpc.call(meta, "meta.mkdir", mine, m.AttrRsp))
        assert ei.value.code == StatusCode.PERMISSION_DENIED
    finally:
        sec.root.run(rpc.close())
    assert not sec.root.exists("/authz/as-other") and not sec.root.exists("/authz/as-self")
