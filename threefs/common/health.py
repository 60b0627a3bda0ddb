"""What a service knows is wrong with itself, reported to mgmtd in its heartbeats and shown by
`threefs status` ("meta node 51: its KV cannot be written: ...").

A problem is recorded under a key when it happens and cleared when the same thing succeeds again; one
not seen again for `ttl_s` expires by itself. Bounded: at most PROBLEMS_MAX keys, each message cut to
PROBLEM_CHARS_MAX characters (they travel in every heartbeat).
"""

from __future__ import annotations

import time

PROBLEMS_MAX = 8
PROBLEM_CHARS_MAX = 300
PROBLEM_TTL_S = 60.0


class Problems:
    def __init__(self, ttl_s: float = PROBLEM_TTL_S, clock=time.monotonic):
        self.ttl_s, self.clock = ttl_s, clock
        self._seen: dict[str, tuple[float, float, str]] = {}  # key -> (first seen, last seen, message)

    def record(self, key: str, message: str) -> None:
        now = self.clock()
        first = self._seen.get(key, (now, now, ""))[0]
        if key not in self._seen and len(self._seen) >= PROBLEMS_MAX:
            return  # the first ones are the most useful; the rest would repeat them
        self._seen[key] = (first, now, message[:PROBLEM_CHARS_MAX])

    def clear(self, key: str) -> None:
        if self._seen:  # the hot path (every successful KV commit) pays one dict check
            self._seen.pop(key, None)

    def current(self) -> list[str]:
        """One line per problem still present: what, and for how long."""
        now = self.clock()
        for key in [k for k, (_, last, _) in self._seen.items() if now - last > self.ttl_s]:
            del self._seen[key]
        return [f"{msg} (for {now - first:.0f} s)" for first, _, msg in self._seen.values()]
