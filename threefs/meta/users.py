"""Who a meta call acts for, and the POSIX permission checks made for it. Pure: no KV, no IO.

Identity. Every RPC connection authenticates with a token, and the token's *principal* says who the caller
is (`CallContext.principal`):

    "cluster"             the cluster token (services, the admin, the FUSE daemon): privileged, acts as root
    "user:NAME#HASH"      a user token issued by mgmtd (mgmtd/users.py): acts as that user's uid / gid,
                          which meta learns from mgmtd's token list (MetaService.set_users)

A privileged principal may act for any user by putting `user` (uid, gid, gids) in a request — the FUSE
daemon passes the uid/gid of the process that made each system call. Anyone else may only name itself.

Checks (Linux's generic_permission, without ACLs): the owner's bits if uid matches, else the group's if
the file's gid is among the caller's groups, else the others'. Root (uid 0) passes every read/write/search
check. The sticky bit on a directory lets only the owner of an entry, the owner of the directory, or root
remove or rename the entry (EPERM otherwise).

One source of truth. A FUSE mount with `default_permissions` has the kernel check every access with the
caller's full credentials (supplementary groups, capabilities) before the daemon hears of it; the daemon
then marks the credential `kernel_checked`, and every check here passes for it (ownership and the setgid
rules the kernel applies too), so meta never refuses what the kernel allowed nor decides differently.
"""

from __future__ import annotations

import stat as st
from typing import NamedTuple

from threefs.common.status import StatusCode, status_error
from threefs.rpc.auth import CLUSTER
from threefs.rpc.schemas.meta import UserCred

ROOT = UserCred(0, 0)
R, W, X = 4, 2, 1  # the permission a check wants (mode-bit values of "others")
GIDS_MAX = 64  # supplementary groups one credential may carry (Linux NGROUPS is larger; FUSE gives one)
ID_MAX = (1 << 32) - 2  # uid/gid are u32; (u32)-1 means "unchanged" in chown and is never an id


class Acl(NamedTuple):
    """The part of an inode a permission check needs. Directory dentries carry it (3FS's dirAcl), so a
    path walk checks search permission without loading every directory's inode."""

    mode: int
    uid: int
    gid: int


def principal_user(principal: str, known: dict[str, UserCred]) -> tuple[UserCred, bool]:
    """(identity, privileged) of an authenticated principal; one that maps to no user is refused."""
    if principal == CLUSTER:
        return ROOT, True
    user = known.get(principal)
    if user is None:
        raise status_error(StatusCode.PERMISSION_DENIED, f"principal {principal!r} maps to no uid/gid (its "
                           "token may have been revoked; ask the admin for a new one)")
    return user, False


def check_cred(user: UserCred) -> UserCred:
    """Reject ids out of range and oversized group lists with a clear error."""
    ids = (user.uid, user.gid, *user.gids)
    if any(not 0 <= i <= ID_MAX for i in ids):
        raise status_error(StatusCode.INVALID_ARGUMENT, f"user {user}: ids must be in [0, {ID_MAX}]")
    if len(user.gids) > GIDS_MAX:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"user has {len(user.gids)} groups, over "
                           f"{GIDS_MAX}")
    return user


def acting_user(principal: str, requested: UserCred | None, known: dict[str, UserCred]) -> UserCred:
    """The user a call acts for: the requested one if the principal is privileged, else the principal's."""
    own, privileged = principal_user(principal, known)
    if requested is None:
        return own
    if privileged or requested == own:
        return check_cred(requested)
    raise status_error(StatusCode.PERMISSION_DENIED, f"principal {principal!r} may not act as uid "
                       f"{requested.uid} (only privileged tokens may pass a user)")


def privileged(user: UserCred) -> bool:
    """Root, or a caller whose permissions the kernel has checked (it also applied the set-id rules)."""
    return user.uid == 0 or user.kernel_checked


def in_group(user: UserCred, gid: int) -> bool:
    return gid == user.gid or gid in user.gids


def allowed(user: UserCred, acl: Acl, want: int) -> bool:
    """Whether `user` has every permission in `want` (R|W|X bits) on an inode with `acl`."""
    if user.uid == 0 or user.kernel_checked:
        return True
    if user.uid == acl.uid:
        bits = (acl.mode >> 6) & 7
    elif in_group(user, acl.gid):
        bits = (acl.mode >> 3) & 7
    else:
        bits = acl.mode & 7
    return bits & want == want


def require(user: UserCred, acl: Acl, want: int, what: str) -> None:
    """EACCES unless `user` has `want` on `acl`; `what` names the inode in the message."""
    if not allowed(user, acl, want):
        need = "".join(c for c, bit in (("r", R), ("w", W), ("x", X)) if want & bit)
        raise status_error(StatusCode.PERMISSION_DENIED, f"permission denied: {what} (uid {user.uid} needs "
                           f"{need} on mode {acl.mode & 0o7777:o} owned by {acl.uid}:{acl.gid})")


def require_owner(user: UserCred, acl: Acl, what: str) -> None:
    """EPERM unless `user` owns the inode or is root (chmod, utimes with explicit times)."""
    if user.uid != 0 and user.uid != acl.uid and not user.kernel_checked:
        raise status_error(StatusCode.NOT_PERMITTED, f"operation not permitted: {what} (uid {user.uid} "
                           f"does not own it; owner is {acl.uid})")


def require_sticky(user: UserCred, dir_acl: Acl, victim_uid: int, what: str) -> None:
    """In a sticky directory only the entry's owner, the directory's owner or root may remove it."""
    if dir_acl.mode & st.S_ISVTX and user.uid not in (0, victim_uid, dir_acl.uid) and not user.kernel_checked:
        raise status_error(StatusCode.NOT_PERMITTED, f"operation not permitted: {what} (the directory is "
                           f"sticky and uid {user.uid} owns neither the entry nor the directory)")


def new_owner(user: UserCred, parent: Acl, mode: int, is_dir: bool) -> tuple[int, int, int]:
    """(uid, gid, mode) of a new inode: a setgid directory passes its group on (and, to directories, the
    setgid bit itself); a non-member creating a setgid file loses the bit (Linux inode_init_owner)."""
    gid = user.gid
    if parent.mode & st.S_ISGID:
        gid = parent.gid
        if is_dir:
            mode |= st.S_ISGID
        elif mode & st.S_ISGID and not privileged(user) and not in_group(user, gid):
            mode &= ~st.S_ISGID
    return user.uid, gid, mode
