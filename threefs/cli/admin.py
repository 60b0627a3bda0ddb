"""`threefs admin ...`: cluster administration through the primary mgmtd (needs the cluster token).

    create-chain-table --table-id N --replicas R [--chains K]   chains over free targets
    add-storage [--dir DIR] [--targets N]                        one more storage service (local cluster)
    offline-target TARGET [--force] / online-target TARGET       take a target out of service and back
    rotate-lastsrv CHAIN                                         give up on a LASTSRV head that is gone
    user-add NAME --uid U [--gid G] / user-token NAME            issue a token (shown once)
    user-revoke NAME / user-list
    target-check PATH / target-migrate PATH / target-compact PATH  offline, on a stopped target (cli/target_cmd.py)
"""

from __future__ import annotations

import asyncio
import time

from threefs.common.config import ClientConfig, find_client_config, load_toml
from threefs.rpc.schemas import mgmtd as ms
from threefs.rpc.schemas.common import Empty


async def _call(config: ClientConfig, method: str, req, rsp_type):
    from threefs.cluster.mgmtd_client import MgmtdClient
    from threefs.rpc.client import RpcClient

    rpc = RpcClient(config.token, client_id="threefs-admin")
    try:
        return await MgmtdClient(rpc, config.mgmtd).call(method, req, rsp_type)
    finally:
        await rpc.close()


def _mgmtd(args, method: str, req, rsp_type):
    config = load_toml(find_client_config(args.config), ClientConfig)
    return asyncio.run(_call(config, method, req, rsp_type))


def cmd_create_chain_table(args) -> int:
    rsp = _mgmtd(args, "create_chain_table", ms.CreateChainTableReq(args.table_id, args.replicas, args.chains),
                 ms.CreateChainTableRsp)
    verb = "created" if rsp.created else "already exists:"
    print(f"chain table {rsp.table.table_id} {verb} {len(rsp.table.chains)} chains x "
          f"{rsp.table.replicas} replicas (chains {', '.join(map(str, rsp.table.chains))})")
    return 0


def cmd_add_storage(args) -> int:
    from threefs.cli.cluster import LocalCluster

    cluster = LocalCluster(args.dir)
    name = cluster.add_storage(args.targets)
    config = cluster.config_of(name)
    print(f"{name} (node {config.node_id}) joined with targets "
          f"{', '.join(str(t.target_id) for t in config.targets)}; they serve once a chain table uses them "
          "(`threefs admin create-chain-table`)")
    return 0


def cmd_offline_target(args) -> int:
    _mgmtd(args, "offline_target", ms.TargetAdminReq(args.target, True, args.force), ms.OkRsp)
    print(f"target {args.target} is offline (its chain goes on without it; "
          f"`threefs admin online-target {args.target}` returns it)")
    return 0


def cmd_online_target(args) -> int:
    _mgmtd(args, "offline_target", ms.TargetAdminReq(args.target, False), ms.OkRsp)
    print(f"target {args.target} returns: it resyncs, then serves (watch `threefs status`)")
    return 0


def cmd_rotate_lastsrv(args) -> int:
    rsp = _mgmtd(args, "rotate_lastsrv", ms.ChainAdminReq(args.chain), ms.ChainRsp)
    print(f"chain {rsp.chain.chain_id} v{rsp.chain.version}: "
          + ", ".join(f"{t.target_id} {t.public_state}" for t in rsp.chain.targets))
    return 0


def _print_token(rsp: ms.UserTokenRsp) -> None:
    print(f"user {rsp.user.name} (uid {rsp.user.uid}, gid {rsp.user.gid}) token:\n{rsp.token}\n"
          "It is shown only this once: put it in the user's client.toml as `token = \"...\"`.")


def cmd_user_add(args) -> int:
    gid = args.uid if args.gid is None else args.gid
    _print_token(_mgmtd(args, "user_add", ms.UserReq(args.name, args.uid, gid), ms.UserTokenRsp))
    return 0


def cmd_user_token(args) -> int:
    _print_token(_mgmtd(args, "user_token", ms.UserReq(args.name), ms.UserTokenRsp))
    return 0


def cmd_user_revoke(args) -> int:
    _mgmtd(args, "user_revoke", ms.UserReq(args.name), ms.OkRsp)
    print(f"token of user {args.name} revoked (services drop it within one routing refresh)")
    return 0


def cmd_user_list(args) -> int:
    rsp = _mgmtd(args, "user_list", Empty(), ms.UserListRsp)
    print(f"{'name':<20} {'uid':>6} {'gid':>6}  token")
    for u in rsp.users:
        issued = time.strftime("%Y-%m-%d %H:%M", time.localtime(u.token_issued_ns / 1e9))
        token = f"sha256 {u.token_sha256[:12]}... issued {issued}" if u.token_sha256 else "revoked"
        print(f"{u.name:<20} {u.uid:>6} {u.gid:>6}  {token}")
    return 0


def add_admin_parser(sub) -> None:
    """Register `threefs admin ...` on the main parser's subcommands."""
    admin = sub.add_parser("admin", help="cluster administration (chain tables, targets, users)")
    cmds = admin.add_subparsers(dest="admin_cmd", required=True)

    p = cmds.add_parser("create-chain-table", help="create a chain table over free targets")
    p.add_argument("--table-id", type=int, required=True)
    p.add_argument("--replicas", type=int, required=True, help="replication factor R")
    p.add_argument("--chains", type=int, default=0, help="chains (default: as many as free targets allow)")
    p.set_defaults(fn=cmd_create_chain_table)
    p = cmds.add_parser("add-storage", help="start one more storage service in a local cluster")
    p.add_argument("--dir", default=".threefs")
    p.add_argument("--targets", type=int, default=None, help="targets of the new service")
    p.set_defaults(fn=cmd_add_storage)
    p = cmds.add_parser("offline-target", help="take a target out of service")
    p.add_argument("target", type=int)
    p.add_argument("--force", action="store_true", help="even if it is its chain's last SERVING target")
    p.set_defaults(fn=cmd_offline_target)
    p = cmds.add_parser("online-target", help="return a target taken offline")
    p.add_argument("target", type=int)
    p.set_defaults(fn=cmd_online_target)
    p = cmds.add_parser("rotate-lastsrv", help="give up on a chain's LASTSRV head (loses writes only it had)")
    p.add_argument("chain", type=int)
    p.set_defaults(fn=cmd_rotate_lastsrv)
    p = cmds.add_parser("user-add", help="add a user and issue its token")
    p.add_argument("name")
    p.add_argument("--uid", type=int, required=True, help="the POSIX uid the user's calls run as")
    p.add_argument("--gid", type=int, default=None, help="its gid (default: the uid)")
    p.set_defaults(fn=cmd_user_add)
    for name, fn, text in (("user-token", cmd_user_token, "issue a new token (the old one stops working)"),
                           ("user-revoke", cmd_user_revoke, "revoke a user's token")):
        p = cmds.add_parser(name, help=text)
        p.add_argument("name")
        p.set_defaults(fn=fn)
    cmds.add_parser("user-list", help="list users").set_defaults(fn=cmd_user_list)
    from threefs.cli.s3_cmd import add_admin_s3_commands  # [s3] access keys for the S3 gateway

    add_admin_s3_commands(cmds)
    from threefs.cli.target_cmd import add_admin_target_commands  # offline tools for a target directory

    add_admin_target_commands(cmds)
