"""Named limits (TigerBeetle: put a limit on everything). Each is enforced where it is used."""

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

# RPC
FRAME_HEADER_BYTES_MAX = 1 * MiB  # msgpack header (method, args) of one frame
FRAME_PAYLOAD_BYTES_MAX = 64 * MiB + 64 * KiB  # bulk bytes after the header
INFLIGHT_REQUESTS_PER_CONNECTION_MAX = 1024
CONNECTIONS_PER_CLIENT_MAX = 64  # authenticated connections one client id may hold to one server
HELLO_TIMEOUT_S = 10.0  # a connection that has not authenticated by then is closed
CALL_TIMEOUT_S_DEFAULT = 30.0
CONNECT_TIMEOUT_S = 5.0

# layout
CHUNK_SIZE_BYTES_MIN = 4 * KiB
CHUNK_SIZE_BYTES_MAX = 64 * MiB
CHUNK_SIZE_BYTES_DEFAULT = 1 * MiB
STRIPE_MAX = 256

# namespace
NAME_BYTES_MAX = 255
PATH_BYTES_MAX = 4096
PATH_DEPTH_MAX = 64
SYMLINK_FOLLOW_MAX = 10
READDIR_PAGE_MAX = 1024
NLINK_MAX = 65_000  # hard links to one file (ext4's limit)
BATCH_STAT_MAX = 1024  # paths or inodes in one batch stat

# batch IO
BATCH_IOS_MAX = 100_000
INFLIGHT_REQUESTS_PER_SERVICE_MAX = 16

# Reads into addresses 8/16 bytes off a 32-byte boundary ran ~10x slower on this machine (measured in
# the chunk engine); IO buffers we allocate start on this alignment.
IO_BUFFER_ALIGN = 64
