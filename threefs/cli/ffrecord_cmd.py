"""`threefs ffrecord ...`: FFRecord sample files (docs/ffrecord.md).

    pack FOLDER OUT [--local] [--reference] [-q]   many small local files -> one .ffr with a name index
    info PATH... [--local] [--json]                  files, versions, samples, sizes
    validate PATH... [--local] [-q]                  read everything, check every CRC32
    ls PACKED [FOLDER] [-r] [--local]                names inside a packed folder

PATH/OUT are threefs paths (the client config of --config / $THREEFS_CONFIG); with --local they are
OS paths (local disk, a FUSE mount) and no cluster is needed. Progress bars (tqdm) show on a terminal.
"""

from __future__ import annotations

import json
import os
import sys

from threefs.cli import client_for
from threefs.common.status import StatusCode, status_error


def _client(args):
    return None if args.local else client_for(args)


def _bar(total: int, quiet: bool, unit: str = "B"):
    from tqdm import tqdm

    # disable=None: no bar when stderr is not a terminal (logs, pipes)
    return tqdm(total=total, unit=unit, unit_scale=True, disable=True if quiet else None,
                file=sys.stderr, dynamic_ncols=True)


def _folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder, followlinks=True)
               for f in files if os.path.isfile(os.path.join(d, f)))


def cmd_pack(args) -> int:
    from threefs.ffrecord.packed import pack_folder

    if not os.path.isdir(args.folder):
        raise status_error(StatusCode.NOT_DIRECTORY, f"{args.folder} is not a local folder")
    client = _client(args)
    try:
        with _bar(_folder_bytes(args.folder), args.quiet) as bar:
            count = pack_folder(args.folder, args.out, client=client, reference=args.reference,
                                progress=bar.update)
    finally:
        if client is not None:
            client.close()
    if not args.quiet:
        print(f"packed {count} files from {args.folder} into {args.out}")
    return 0


def _open(args, client, path: str):
    from threefs.ffrecord.reader import FileReader

    return FileReader(path, check_data=True, client=client)


def cmd_info(args) -> int:
    client = _client(args)
    try:
        rows = []
        for path in args.paths:
            with _open(args, client, path) as r:
                for k, name in enumerate(r.fnames):
                    offsets = r.get_offsets(k)
                    n = len(offsets) - 1
                    rows.append({"file": name, "version": r.version_of(k), "samples": n,
                                 "bytes": int(offsets[-1]),
                                 "sample_bytes_avg": int((offsets[-1] - offsets[0]) // n) if n else 0})
    finally:
        if client is not None:
            client.close()
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for row in rows:
            print(f"{row['file']}  v{row['version']}  {row['samples']} samples  {row['bytes']} bytes  "
                  f"avg {row['sample_bytes_avg']} B/sample")
        print(f"total: {sum(r['samples'] for r in rows)} samples in {len(rows)} files")
    return 0


def cmd_validate(args) -> int:
    client = _client(args)
    try:
        for path in args.paths:
            with _open(args, client, path) as r:
                total = int(r.sample_lengths().sum())
                with _bar(total, args.quiet) as bar:
                    r.validate(progress=bar.update)
                print(f"{path}: {r.n} samples in {len(r.fnames)} files, every checksum matches")
    finally:
        if client is not None:
            client.close()
    return 0


def cmd_ls(args) -> int:
    from threefs.ffrecord.packed import PackedFolder

    client = _client(args)
    try:
        with PackedFolder(args.packed, client=client) as pf:
            for name in pf.list(args.folder, recursive=args.recursive):
                print(name + ("/" if pf.is_dir(os.path.join(args.folder or "", name)) else ""))
    finally:
        if client is not None:
            client.close()
    return 0


def add_ffrecord_parser(sub) -> None:
    """Register `threefs ffrecord ...` on the `threefs` argument parser's subparsers."""
    p = sub.add_parser("ffrecord", help="FFRecord sample files: pack, info, validate, ls")
    cmds = p.add_subparsers(dest="ffrecord_cmd", required=True)
    pack = cmds.add_parser("pack", help="pack a local folder of small files into one .ffr file")
    pack.add_argument("folder", help="local folder to pack")
    pack.add_argument("out", help="output .ffr (a threefs path; an OS path with --local)")
    pack.add_argument("--reference", action="store_true",
                      help="HFAiLab ffrecord's layout (v1 + pickle index) so ffrecord.PackedFolder reads it")
    pack.set_defaults(fn=cmd_pack)
    info = cmds.add_parser("info", help="files, versions, samples and sizes of FFRecord files")
    info.add_argument("paths", nargs="+", help=".ffr files or directories of them")
    info.add_argument("--json", action="store_true")
    info.set_defaults(fn=cmd_info)
    val = cmds.add_parser("validate", help="read every sample and check its CRC32")
    val.add_argument("paths", nargs="+", help=".ffr files or directories of them")
    val.set_defaults(fn=cmd_validate)
    ls = cmds.add_parser("ls", help="list names inside a packed folder")
    ls.add_argument("packed", help="a .ffr made by `ffrecord pack`")
    ls.add_argument("folder", nargs="?", default=None, help="a folder inside the pack (default: top)")
    ls.add_argument("-r", dest="recursive", action="store_true", help="recursive")
    ls.set_defaults(fn=cmd_ls)
    for c in (pack, info, val, ls):
        c.add_argument("--local", action="store_true", help="paths are OS paths, not threefs paths")
        c.add_argument("-q", dest="quiet", action="store_true", help="no progress bar or summary")
