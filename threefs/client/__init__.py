"""The client library: what workloads (checkpoint, ffrecord, kvcache, pond, s3, ...) and users import.

    import threefs
    fs = threefs.connect()                 # a threefs.client.Client
    if fs.stat(path).type == threefs.client.DIRECTORY: ...

Names re-exported here are the public API; workloads never import another service's RPC schemas.
"""

from threefs.rpc.schemas.meta import (
                                      DIRECTORY,
                                      FILE,
                                      NO_PARENT,
                                      SYMLINK,
                                      UTIME_NOW,
                                      DirEntry,
                                      InodeAttr,
                                      StatfsRsp,
                                      UserCred,
)

__all__ = ["DIRECTORY", "FILE", "NO_PARENT", "SYMLINK", "UTIME_NOW", "DirEntry", "InodeAttr", "StatfsRsp", "UserCred"]
