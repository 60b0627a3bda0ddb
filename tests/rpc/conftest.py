"""Every RPC test runs over both transports a client may use: a same-host server's Unix socket (the default
on one host, common/local_socket.py) and TCP (what crosses hosts; THREEFS_RPC_LOCAL=0 makes a client use it)."""

import pytest


@pytest.fixture(autouse=True, params=["unix", "tcp"])
def transport(request, monkeypatch):
    monkeypatch.setenv("THREEFS_RPC_LOCAL", "1" if request.param == "unix" else "0")
    return request.param
