"""Control commands of the soak, run in its client namespace (the cluster's addresses live there):

    python -m threefs.testing.soak_ctl CLIENT_CONF ready REPLICAS STORAGE   chain table, all SERVING
    python -m threefs.testing.soak_ctl CLIENT_CONF heal                     wait until all SERVING again
    python -m threefs.testing.soak_ctl CLIENT_CONF verify OUT_DIR           check the acknowledgements

Each prints one JSON line last and exits 0, or exits 1 saying why.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from threefs.client.client import Client
from threefs.common.status import ThreeFSError
from threefs.rpc.schemas import mgmtd as ms
from threefs.testing.soak_worker import verify

DEADLINE_S = 600.0


def target_states(fs: Client) -> dict[int, str]:
    routing = fs.run(fs.aio.mgmtd.refresh(force=True))
    return {t.target_id: t.public_state for t in routing.info.targets.values() if t.chain_id}


def wait_serving(fs: Client, replicas: int = 0, storage: int = 0) -> dict[int, str]:
    deadline = time.monotonic() + DEADLINE_S
    last = "no answer yet"
    while time.monotonic() < deadline:
        try:
            routing = fs.run(fs.aio.mgmtd.refresh(force=True))
            if replicas and len(routing.nodes_of_type(ms.STORAGE)) >= storage and 1 not in routing.info.tables:
                fs.run(fs.aio.mgmtd.call("create_chain_table", ms.CreateChainTableReq(1, replicas),
                                          ms.CreateChainTableRsp))
            states = target_states(fs)
            last = json.dumps(states)
            if 1 in routing.info.tables and states and set(states.values()) == {ms.SERVING}:
                fs.stat("/")
                return states
        except ThreeFSError as exc:
            last = f"{exc.code.name}: {exc}"
        time.sleep(0.5)
    raise SystemExit(f"not every target SERVING after {DEADLINE_S:.0f} s: {last}")


def main(argv: list[str]) -> int:
    conf, command, *rest = argv
    deadline = time.monotonic() + 120
    while True:  # the cluster may be between primaries when we start
        try:
            fs = Client.connect(conf)
            break
        except ThreeFSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    try:
        if command == "ready":
            print(json.dumps(wait_serving(fs, int(rest[0]), int(rest[1]))))
        elif command == "heal":
            print(json.dumps(wait_serving(fs)))
        elif command == "verify":
            print(json.dumps(verify(fs, Path(rest[0]))))
        else:
            raise SystemExit(f"unknown command {command}")
    finally:
        fs.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
