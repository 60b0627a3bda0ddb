"""A TCP proxy for fault tests: forwards a listen address to a service and, when armed, damages bytes
on their way back to the client (a bad NIC, a memory flip) or stalls them (a slow link).

    proxy = FaultProxy(("127.0.0.2", port), ("127.0.0.1", port)).start()
    proxy.corrupt_next(1)          # flip one byte in the middle of the next big server -> client read
    ...
    proxy.stop()

It runs its own event loop in a daemon thread, so a synchronous test (or the soak harness) can use it.
Only loopback addresses are allowed: fault tests never send traffic anywhere else.
"""

from __future__ import annotations

import asyncio
import ipaddress
import threading

BIG_READ_BYTES = 8 * 1024  # a server -> client read this large is inside a data payload, not a header


class FaultProxy:
    def __init__(self, listen: tuple[str, int], upstream: tuple[str, int]):
        for host, _ in (listen, upstream):
            if not ipaddress.ip_address(host).is_loopback:
                raise ValueError(f"FaultProxy serves loopback addresses only, not {host}")
        self.listen, self.upstream = listen, upstream
        self.flipped = 0  # bytes damaged so far
        self.connections = 0
        self._to_flip = 0
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._server: asyncio.AbstractServer | None = None

    def start(self) -> "FaultProxy":
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        fut.result(timeout=10)
        return self

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._serve, *self.listen)

    def corrupt_next(self, n: int = 1) -> None:
        """Damage one byte in each of the next `n` big server -> client reads."""
        with self._lock:
            self._to_flip += n

    def _take_flip(self) -> bool:
        with self._lock:
            if self._to_flip <= 0:
                return False
            self._to_flip -= 1
            self.flipped += 1
            return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*self.upstream), 10)
        except (OSError, TimeoutError):
            writer.close()
            return
        await asyncio.gather(self._pump(reader, up_writer, damage=False),
                             self._pump(up_reader, writer, damage=True), return_exceptions=True)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, damage: bool) -> None:
        try:
            while True:
                data = await reader.read(256 * 1024)
                if not data:
                    break
                if damage and len(data) >= BIG_READ_BYTES and self._take_flip():
                    data = bytearray(data)
                    data[len(data) // 2] ^= 0x5A
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    def stop(self) -> None:
        async def close():
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:  # the connections' pumps end with the proxy
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
