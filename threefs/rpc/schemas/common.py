"""Schemas shared by every service: the connection handshake."""

import msgspec

PROTOCOL_VERSION = 1


class Hello(msgspec.Struct):
    token: str
    client_id: str
    protocol: int = PROTOCOL_VERSION


class HelloRsp(msgspec.Struct):
    service: str
    protocol: int = PROTOCOL_VERSION


class Empty(msgspec.Struct):
    pass
