"""Consumer-group membership by leases stored in threefs, and the assignment of partitions to members.

A member is the symlink ROOT/.groups/GROUP/members/MEMBER; its target lists the topics it subscribes to
and its mtime is its lease: every heartbeat sets the mtime to "now" on the meta server (setattr with
UTIME_NOW), and the reply carries that time, so every member judges every lease by the same clock (the meta
servers'), never by its own. A member whose mtime is older than the session timeout is dead: whoever sees
it first removes it. Every member computes the same assignment from the same list of live members
(`assign`): partition p of a topic goes to the (p mod n)-th of the n members subscribed to it, sorted by
id. While views differ (for about one heartbeat after a join or a death) two members may both read a
partition — duplicates, never a gap: delivery is at least once, and a committed offset is only ever a
position up to which some member delivered everything (see docs/queue.md).
"""

from __future__ import annotations

import logging

from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.queue.log import SYMLINK, group_dir, run

log = logging.getLogger(__name__)

MEMBERS_MAX = 1024
UTIME_NOW = -1  # setattr: "the meta server's current time" (utimensat's UTIME_NOW)


def assign(partitions: dict[str, int], members: dict[str, tuple[str, ...]]) -> dict[str, list[tuple[str, int]]]:
    """member -> [(topic, partition)]: each topic's partitions spread round-robin over the members subscribed
    to it, in member-id order. Pure, so every member computes the same answer from the same view."""
    out: dict[str, list[tuple[str, int]]] = {m: [] for m in members}
    for topic, n in sorted(partitions.items()):
        subs = sorted(m for m, topics in members.items() if topic in topics)
        for p in range(n):
            if subs:
                out[subs[p % len(subs)]].append((topic, p))
    return out


class Membership:
    def __init__(self, fs, root: str, group: str, member_id: str, topics: list[str], session_timeout_s: float):
        self.fs = fs
        self.dir = f"{group_dir(root, group)}/members"
        self.member_id = member_id
        self.topics = tuple(sorted(topics))
        self.session_timeout_ns = int(session_timeout_s * 1e9)
        self.path = f"{self.dir}/{member_id}"

    def join(self) -> None:
        self.fs.mkdir(self.dir, parents=True, exist_ok=True)
        try:
            self.fs.symlink(",".join(self.topics), self.path)
        except FileExistsError:
            target = self.fs.readlink(self.path)
            if tuple(t for t in target.split(",") if t) != self.topics:
                raise status_error(StatusCode.EXISTS, f"member id {self.member_id!r} is in use in "
                                   f"{self.dir} with other topics ({target})") from None

    def heartbeat(self) -> dict[str, tuple[str, ...]]:
        """Renew this member's lease; return the live members and their topics (this one included)."""
        try:
            attr = run(self.fs, self.fs.aio.setattr(self.path, follow=False, atime_ns=UTIME_NOW,
                                                    mtime_ns=UTIME_NOW))
        except FileNotFoundError:  # others took us for dead (a long pause): join again
            log.warning("group member %s was expired by others; joining again", self.path)
            self.join()
            attr = run(self.fs, self.fs.aio.setattr(self.path, follow=False, atime_ns=UTIME_NOW,
                                                    mtime_ns=UTIME_NOW))
        now_ns = attr.mtime_ns
        return self.live_members(now_ns)

    def live_members(self, now_ns: int) -> dict[str, tuple[str, ...]]:
        rsp = run(self.fs, self.fs.aio.readdir(self.dir, "", MEMBERS_MAX))
        names = [e.name for e in rsp.entries]
        attrs = run(self.fs, self.fs.aio.batch_stat([f"{self.dir}/{n}" for n in names], follow=False))
        live: dict[str, tuple[str, ...]] = {}
        for name, a in zip(names, attrs):
            if isinstance(a, ThreeFSError) or a.type != SYMLINK:
                continue
            if now_ns - a.mtime_ns > self.session_timeout_ns and name != self.member_id:
                self._expire(name)
                continue
            live[name] = tuple(t for t in a.symlink_target.split(",") if t)
        live.setdefault(self.member_id, self.topics)
        return live

    def _expire(self, name: str) -> None:
        try:
            self.fs.remove(f"{self.dir}/{name}")
            log.info("group member %s/%s expired", self.dir, name)
        except FileNotFoundError:
            pass  # another member was first

    def leave(self) -> None:
        try:
            self.fs.remove(self.path)
        except FileNotFoundError:
            pass
