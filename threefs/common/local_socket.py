"""Same-host connections over Unix domain sockets, found by the TCP address they stand for.

A server that listens on TCP `HOST:PORT` also listens on the Unix socket named `NAME_PREFIX + "HOST:PORT"`
in Linux's abstract namespace (one for each address by which TCP reaches that listener from this namespace:
see `addresses`). A client that is to call `ADDR` first connects to that name; when nothing listens there
(ECONNREFUSED, at once: no file, no timeout) it connects over TCP as before. The wire, the hello, the tokens
and everything above are the same on both.

Why: a round trip over loopback TCP pays the TCP/IP stack twice per message (the sender's system call runs
the receiver's TCP input too); a Unix socket hands the bytes over directly. Measured on this machine's kind
(a 120-byte ping-pong between two Python processes, blocking sockets): 56-75 us per round trip over TCP,
31-42 us over a Unix socket; 23-29 us of the caller's CPU per round trip against 12-16 us.

Why this is safe:
- Abstract names belong to a network namespace, as TCP ports on its addresses do: a client reaches a name
  only in its own namespace, where `HOST:PORT` leads to the same process over TCP (only such addresses get
  a name: not an advertised address that a proxy or NAT answers). A client in another namespace (another
  "host" of a test lab) finds no name and uses TCP, so cutting or capping a namespace's link still cuts or
  caps every connection that crosses it.
- The name is held by the process that holds the TCP port and goes away with it (abstract sockets leave no
  file behind): a restarted server takes it over, a dead one leaves nothing that answers.
- A name that another process holds already stops the server from starting, as a taken TCP port does
  (`EADDRINUSE`, naming the address): whoever holds a name gets its same-host clients, so a server never
  runs while someone else answers for it. Holding a name needs what holding the port needs (being in the
  namespace, first); unlike a TCP port below 1024, no name is reserved to root.

A blocking client waits for answers in poll() on a Unix socket (rpc/blocking.py): a reader blocked in
recv() there is also woken when the server reads its request, a wasted context switch per call.

`THREEFS_RPC_LOCAL=0` in a client's environment makes it use TCP only; `local_socket = false` in a service's
config makes the service listen on TCP only (its clients then use TCP).
"""

from __future__ import annotations

import errno
import os
import socket

NAME_PREFIX = "\0threefs-rpc/"
ENV = "THREEFS_RPC_LOCAL"
WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def enabled() -> bool:
    """Whether this process's clients try the Unix socket first (read at each connect)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def name_of(addr: str) -> str:
    return NAME_PREFIX + addr


def addresses(listen_host: str, port: int, advertise_host: str = "") -> list[str]:
    """The addresses by which a TCP connect from this namespace reaches the listener on `listen_host:port`,
    in a stable order: the listen address; with a wildcard listener, loopback, localhost and the advertised
    host when it is an address of this namespace. An advertised address that is not one the listener
    covers (a proxy or NAT in front of the server, as tests/e2e/test_read_integrity.py has) gets no name:
    same-host clients dialing it go through whatever stands there, over TCP, as before."""
    out = [f"{listen_host}:{port}"]
    if listen_host in WILDCARDS:
        out += [f"127.0.0.1:{port}", f"localhost:{port}"]
        if advertise_host and _is_local(advertise_host):
            out.append(f"{advertise_host}:{port}")
    elif listen_host == "127.0.0.1":
        out.append(f"localhost:{port}")
    seen: set[str] = set()
    return [a for a in out if not (a in seen or seen.add(a))]


def _is_local(host: str) -> bool:
    """Whether every address `host` resolves to belongs to this network namespace (can be bound here)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((sockaddr[0], 0))
            except OSError:
                return False
    return bool(infos)


def listen(addr: str, backlog: int = 1024) -> socket.socket:
    """A listening non-blocking Unix socket named for `addr`; OSError(EADDRINUSE) when the name is held."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(name_of(addr))
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise OSError(errno.EADDRINUSE, f"the same-host socket for {addr} (@{name_of(addr)[1:]}) is held "
                          "by another process (another server of that address?)") from None
        raise
    sock.setblocking(False)
    return sock


def listen_all(listen_host: str, port: int, advertise_host: str = "") -> list[tuple[str, socket.socket]]:
    """(address, listening socket) for every name of `addresses`; all or none (OSError: none left open)."""
    out: list[tuple[str, socket.socket]] = []
    try:
        for addr in addresses(listen_host, port, advertise_host):
            out.append((addr, listen(addr)))
    except BaseException:
        for _, sock in out:
            sock.close()
        raise
    return out


def connect_blocking(addr: str, timeout: float) -> socket.socket | None:
    """A connected blocking Unix socket to the server of `addr` on this host, or None (use TCP)."""
    return _connect(addr, timeout)


def connect_nonblocking(addr: str) -> socket.socket | None:
    """A connected non-blocking Unix socket (for an event loop's transport), or None (use TCP).

    A connect to a listening Unix socket completes at once, or fails with EAGAIN when the server's backlog
    is full: that connect then goes over TCP, which waits for room."""
    return _connect(addr, None)


def _connect(addr: str, timeout: float | None) -> socket.socket | None:
    if not enabled():
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    if timeout is None:
        sock.setblocking(False)
    try:
        sock.connect(name_of(addr))
    except (ConnectionRefusedError, FileNotFoundError, BlockingIOError):
        sock.close()
        return None
    except BaseException:
        sock.close()
        raise
    return sock
