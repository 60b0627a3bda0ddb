"""The lease of a named producer (`Producer(producer_id=...)`): at most one live producer per id.

ROOT/.producers/ID is a symlink whose mtime is the lease, renewed every LEASE_RENEW_S by setting it to the
meta server's "now" (as group members do, so one clock judges every lease). A producer that finds the lease
fresh refuses to start (EXISTS): the one holding it may be appending to its segments, and the newcomer
would cut a "torn tail" that is really a batch in flight. A stale lease (its holder died) is taken over;
the newcomer then repairs the last segment. A holder that finds its lease gone or taken stops with EXISTS.
"""

from __future__ import annotations

import logging
import threading

from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.queue.log import run

log = logging.getLogger(__name__)

LEASE_TIMEOUT_S = 10.0
LEASE_RENEW_S = 2.0
UTIME_NOW = -1


class ProducerLease:
    def __init__(self, fs, root: str, producer_id: str, on_lost, timeout_s: float = LEASE_TIMEOUT_S):
        self.fs = fs
        self.dir = f"{root.rstrip('/')}/.producers"
        self.path = f"{self.dir}/{producer_id}"
        self.producer_id = producer_id
        self.timeout_ns = int(timeout_s * 1e9)
        self.on_lost = on_lost
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._token = ""

    def acquire(self) -> None:
        import uuid

        self.fs.mkdir(self.dir, parents=True, exist_ok=True)
        self._token = uuid.uuid4().hex
        try:
            self.fs.symlink(self._token, self.path)
        except FileExistsError:
            held = self.fs.lstat(self.path)
            now_ns = self._meta_now()
            age_s = (now_ns - held.mtime_ns) / 1e9
            if now_ns - held.mtime_ns < self.timeout_ns:
                raise status_error(StatusCode.EXISTS, f"producer id {self.producer_id!r} is in use (its lease "
                                   f"was renewed {age_s:.1f} s ago); use another id, or wait "
                                   f"{self.timeout_ns / 1e9:.0f} s after that producer stopped") from None
            log.warning("taking over the lease of producer %s (stale for %.1f s)", self.producer_id, age_s)
            try:
                self.fs.remove(self.path)
            except FileNotFoundError:
                pass
            try:
                self.fs.symlink(self._token, self.path)
            except FileExistsError:
                raise status_error(StatusCode.EXISTS, f"producer id {self.producer_id!r} was just taken by "
                                   "another producer") from None
        self._thread = threading.Thread(target=self._renew_main, name="threefs-producer-lease", daemon=True)
        self._thread.start()

    def _meta_now(self) -> int:
        clock = f"{self.dir}/.clock"
        try:
            return run(self.fs, self.fs.aio.setattr(clock, follow=False, mtime_ns=UTIME_NOW)).mtime_ns
        except FileNotFoundError:
            try:
                self.fs.symlink("clock", clock)
            except FileExistsError:
                pass
            return run(self.fs, self.fs.aio.setattr(clock, follow=False, mtime_ns=UTIME_NOW)).mtime_ns

    def _renew_main(self) -> None:
        while not self._stop.wait(LEASE_RENEW_S):
            try:
                if self.fs.readlink(self.path) != self._token:
                    raise FileNotFoundError("taken")
                run(self.fs, self.fs.aio.setattr(self.path, follow=False, mtime_ns=UTIME_NOW))
            except FileNotFoundError:
                self.on_lost(status_error(StatusCode.EXISTS, f"the lease of producer id {self.producer_id!r} "
                                          "was taken over (this producer was presumed dead); it stops"))
                return
            except ThreeFSError as e:  # meta unreachable: keep trying; others may take over meanwhile
                log.warning("renewing producer lease %s: %s", self.path, e)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=LEASE_TIMEOUT_S)
        try:
            if self.fs.readlink(self.path) == self._token:
                self.fs.remove(self.path)
        except FileNotFoundError:
            pass
        except ThreeFSError as e:  # the lease expires by itself
            log.warning("releasing producer lease %s: %s", self.path, e)
