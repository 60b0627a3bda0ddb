"""`threefs kvcache ls|stats|clear`: the context caches of the cluster (threefs.kvcache).

    threefs kvcache ls                 every cache: root, pages, used/capacity, hit rate, evictions
    threefs kvcache stats [ROOT]       all figures of one cache (or all), --json for scripts
    threefs kvcache clear ROOT         remove every entry (needs write permission on ROOT); --drop also
                                       forgets its page size/capacity and removes its files
"""

from __future__ import annotations

import json

from threefs.common.status import StatusCode, status_error


def _client(args):
    from threefs.client.client import Client

    return Client.connect(args.config)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def all_stats(fs, timeout_s: float = 10.0) -> list[dict]:
    from threefs.kvcache.client import service_call

    return service_call(fs, "stats", {}, timeout_s)


def stats_lines(rows: list[dict]) -> list[str]:
    """One line per cache (also used by `threefs status`)."""
    out = []
    for r in sorted(rows, key=lambda r: r["root"]):
        lookups = r["get_hits"] + r["get_misses"]
        out.append(f"{r['root']:<32} {r['pages']:>9} pages  {_human(r['used_bytes']):>10} / "
                   f"{_human(r['capacity_bytes']):<10} page {_human(r['page_bytes']):>9}  hit rate "
                   f"{r['hit_rate']:6.1%} of {lookups}  evictions {r['evictions']}"
                   + (f"  expired {r['expirations']}" if r["ttl_s"] else ""))
    return out


def cmd_ls(args) -> int:
    with _client(args) as fs:
        rows = all_stats(fs)
    if args.json:
        print(json.dumps(rows, indent=2))
    elif not rows:
        print("no kvcaches")
    else:
        print("\n".join(stats_lines(rows)))
    return 0


def cmd_stats(args) -> int:
    with _client(args) as fs:
        rows = all_stats(fs)
    if args.root:
        root = "/" + args.root.strip("/")
        rows = [r for r in rows if r["root"] == root]
        if not rows:
            raise status_error(StatusCode.NOT_FOUND, f"no kvcache at {root} (`threefs kvcache ls` lists them)")
    if args.json:
        print(json.dumps(rows if not args.root else rows[0], indent=2))
        return 0
    for r in rows:
        print(r["root"])
        for k, v in r.items():
            if k != "root":
                print(f"  {k:<16} {v:.4f}" if isinstance(v, float) else f"  {k:<16} {v}")
    return 0


def cmd_clear(args) -> int:
    from threefs.kvcache import KVCache

    with _client(args) as fs:
        cache = KVCache(fs, "/" + args.root.strip("/"), page_bytes=0, capacity_bytes=0, create=False)
        if not cache.writable:
            raise status_error(StatusCode.PERMISSION_DENIED, f"kvcache {cache.root}: clearing needs write "
                               "permission on it")
        n = cache.clear(drop=args.drop)
        cache.close()
    print(f"{'dropped' if args.drop else 'cleared'} {cache.root}: {n} pages removed")
    return 0


def add_kvcache_parser(sub) -> None:
    p = sub.add_parser("kvcache", help="LLM context caches: ls, stats, clear")
    kv = p.add_subparsers(dest="kvcache_cmd", required=True)
    ls = kv.add_parser("ls", help="every cache with its size, hit rate and evictions")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(fn=cmd_ls)
    st = kv.add_parser("stats", help="all figures of one cache (or of all)")
    st.add_argument("root", nargs="?", default=None)
    st.add_argument("--json", action="store_true")
    st.set_defaults(fn=cmd_stats)
    cl = kv.add_parser("clear", help="remove every entry of a cache")
    cl.add_argument("root")
    cl.add_argument("--drop", action="store_true", help="also forget the cache and remove its files")
    cl.set_defaults(fn=cmd_clear)
