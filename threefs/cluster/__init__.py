"""How a participant of the cluster sees and reaches the others: the routing model (`routing`), the
RPC stubs of mgmtd and storage (`mgmtd_client`, `storage_client`) and the node heartbeat loop
(`heartbeat`). Below the services (mgmtd, meta, storage talk to each other through it) and below the
user-facing client package."""
