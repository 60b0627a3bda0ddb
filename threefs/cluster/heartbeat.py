"""A node's heartbeats to the primary mgmtd, shared by meta and storage.

One loop per service process, for its lifetime. A failed beat is retried soon (a mgmtd failover is
short); a beat answered NODE_NOT_FOUND (mgmtd forgot the node: it was removed, or a new primary's KV
does not have it) re-registers. Nothing that fails inside the loop ends it: a node whose heartbeat loop
died would look alive while mgmtd fails it (and a storage node would stay fenced for good).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from threefs.common.status import StatusCode, ThreeFSError

log = logging.getLogger(__name__)

HEARTBEAT_RETRY_S = 0.25  # after a failed heartbeat, try again this soon (a failover is short)


async def heartbeat_loop(name: str, interval_s: float, beat: Callable[[], Awaitable[None]],
                         register: Callable[[], Awaitable[None]],
                         on_failure: Callable[[], None] | None = None) -> None:
    """Call `beat()` every `interval_s`; on NODE_NOT_FOUND call `register()`. Runs until cancelled.

    `on_failure()` runs after every failed beat or registration (storage notes its fence there)."""
    while True:
        delay = interval_s
        try:
            await beat()
        except ThreeFSError as e:
            delay = min(delay, HEARTBEAT_RETRY_S)
            if on_failure is not None:
                on_failure()
            if e.code != StatusCode.NODE_NOT_FOUND:
                log.warning("%s: heartbeat failed: %s", name, e)
            else:
                log.warning("%s: mgmtd does not know this node: registering again", name)
                try:
                    await register()
                except ThreeFSError as e2:  # mgmtd failing over: the next beat tries again
                    log.warning("%s: registration failed (retrying in %.2f s): %s", name, delay, e2)
                    if on_failure is not None:
                        on_failure()
        await asyncio.sleep(delay)
