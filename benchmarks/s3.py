"""The S3 gateway beside nginx serving the same bytes as plain files over HTTP, in one run.

    .venv/bin/python benchmarks/s3.py [--mib 256] [--sizes 1,4,16,64] [--clients 4] [--small 2000]
                                      [--storage 3] [--replicas 3] [--nginx-workers 1] [--gateway-workers 1]
                                      [--big-gib 5]

nginx (Debian's, started here on loopback: sendfile, keep-alive, WebDAV PUT into a temp file then
rename — the same atomic-replace semantics as the gateway) is the ceiling of "files over HTTP" on this
machine. Both are driven by the same client: threads with keep-alive connections (http.client), GET
bodies received with readinto into a reused buffer; the gateway's requests are presigned SigV4 URLs
(UNSIGNED-PAYLOAD), so the client spends no time hashing. For each object size: PUT MB/s, GET MB/s
(objects written first, then read `--mib` MiB in total per size), then 4 KiB objects: PUT and GET ops/s.
Prints the gateway / nginx ratios (goal: GET >= 0.7x for 1-64 MiB) and the load average.
"""

from __future__ import annotations

import argparse
import http.client
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from urllib.parse import urlsplit

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.common import local_cluster  # noqa: E402
from threefs.cli.s3_cmd import wait_listening  # noqa: E402
from threefs.common.net import free_port  # noqa: E402

MiB = 1 << 20
NGINX_CONF = """
{user}
worker_processes {workers};
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    sendfile on; tcp_nopush on; tcp_nodelay on;
    keepalive_requests 1000000; keepalive_timeout 75;
    client_max_body_size 0; client_body_buffer_size 1m;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy; fastcgi_temp_path {dir}/fcgi; uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    server {{
        listen 127.0.0.1:{port};
        root {dir}/www;
        location / {{ dav_methods PUT; create_full_put_path on; }}
    }}
}}
"""


class Nginx:
    def __init__(self, base: str, workers: int):
        self.dir = os.path.join(base, "nginx")
        os.makedirs(os.path.join(self.dir, "www", "bench"), exist_ok=True)
        self.port = free_port()
        conf = os.path.join(self.dir, "nginx.conf")
        with open(conf, "w") as f:
            # as root, workers would run as nobody and could not write the PUT files
            user = f"user {pwd.getpwuid(os.geteuid()).pw_name};" if os.geteuid() == 0 else ""
            f.write(NGINX_CONF.format(dir=self.dir, port=self.port, workers=workers, user=user))
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        self.proc = subprocess.Popen([nginx, "-c", conf, "-p", self.dir], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        wait_listening("127.0.0.1", self.port, self.proc)

    def url(self, key: str, method: str = "GET") -> str:
        return f"http://127.0.0.1:{self.port}/bench/{key}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: master and workers
            self.proc.wait(timeout=10)


class Gateway:
    def __init__(self, cluster, base: str, workers: int = 1):
        self.port = free_port()
        log = open(os.path.join(base, "gateway.log"), "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "threefs.s3.server", "--config",
                                      str(cluster.client_config_path), "--port", str(self.port),
                                      "--workers", str(workers)],
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        wait_listening("127.0.0.1", self.port, self.proc)
        import boto3
        from botocore.config import Config

        from threefs.client.client import Client
        from threefs.s3.keys import add_key

        with Client.connect(str(cluster.client_config_path)) as fs:
            key = add_key(fs, "/", "root", 0, 0)
        self.s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{self.port}", aws_access_key_id=key[0],
                               aws_secret_access_key=key[1], region_name="us-east-1",
                               config=Config(signature_version="s3v4", s3={"addressing_style": "path"}))
        self.s3.create_bucket(Bucket="bench")

    def url(self, key: str, method: str = "GET") -> str:
        op = "get_object" if method == "GET" else "put_object"
        return self.s3.generate_presigned_url(op, Params={"Bucket": "bench", "Key": key}, ExpiresIn=3600)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=15)


def _run(urls: list[tuple[str, str]], clients: int, body: bytes | None, size: int) -> float:
    """Send every (method, url) over `clients` keep-alive connections; returns seconds."""
    errors: list[str] = []
    lock = threading.Lock()
    todo = list(reversed(urls))

    def worker():
        conn = None
        buf = bytearray(max(size, 1))
        view = memoryview(buf)
        while True:
            with lock:
                if not todo or errors:
                    break
                method, url = todo.pop()
            u = urlsplit(url)
            if conn is None:
                conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
            path = u.path + ("?" + u.query if u.query else "")
            conn.request(method, path, body=body if method == "PUT" else None,
                         headers={"Content-Length": str(len(body))} if method == "PUT" else {})
            r = conn.getresponse()
            if method == "GET":
                got = 0
                while True:
                    n = r.readinto(view[got:])
                    if not n:
                        break
                    got += n
                if r.status != 200 or got != size:
                    errors.append(f"GET {url}: {r.status}, {got} of {size} bytes")
            else:
                text = r.read()
                if r.status not in (200, 201, 204):
                    errors.append(f"PUT {url}: {r.status} {text[:200]!r}")
        if conn is not None:
            conn.close()

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise RuntimeError(errors[0])
    return seconds


def bench_size(name: str, server, size: int, total: int, clients: int) -> tuple[float, float]:
    count = max(clients, total // size)
    body = os.urandom(size)
    keys = [f"s{size}/{i}" for i in range(count)]
    put = _run([("PUT", server.url(k, "PUT")) for k in keys], clients, body, size)
    get = min(_run([("GET", server.url(k)) for k in keys], clients, None, size) for _ in range(2))
    return count * size / put / 1e6, count * size / get / 1e6


def _vm_hwm_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def big_upload(gw: Gateway, gib: float, part_mib: int = 64) -> None:
    """A multipart upload of `gib` GiB streamed from a generator (neither side holds it), then read
    back; prints MB/s both ways and the gateway's peak RSS (VmHWM) before and after."""
    total, part = int(gib * (1 << 30)), part_mib * MiB
    block = os.urandom(MiB)
    base = _vm_hwm_mib(gw.proc.pid)
    uid = gw.s3.create_multipart_upload(Bucket="bench", Key="big")["UploadId"]
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=600)
    parts, done, n = [], 0, 1
    t0 = time.perf_counter()
    while done < total:
        size = min(part, total - done)
        url = gw.s3.generate_presigned_url("upload_part", Params={
            "Bucket": "bench", "Key": "big", "UploadId": uid, "PartNumber": n}, ExpiresIn=3600)
        u = urlsplit(url)
        conn.request("PUT", f"{u.path}?{u.query}", body=(block[:min(MiB, size - i)] for i in range(0, size, MiB)),
                     headers={"Content-Length": str(size)})
        r = conn.getresponse()
        r.read()
        assert r.status == 200, r.status
        parts.append({"PartNumber": n, "ETag": r.headers["ETag"]})
        done, n = done + size, n + 1
    t_parts = time.perf_counter() - t0
    gw.s3.complete_multipart_upload(Bucket="bench", Key="big", UploadId=uid, MultipartUpload={"Parts": parts})
    t_put = time.perf_counter() - t0
    after_put = _vm_hwm_mib(gw.proc.pid)
    t0 = time.perf_counter()
    conn.request("GET", urlsplit(gw.url("big")).path + "?" + urlsplit(gw.url("big")).query)
    r = conn.getresponse()
    buf = memoryview(bytearray(MiB))
    read = 0
    while (k := r.readinto(buf)):
        read += k
    t_get = time.perf_counter() - t0
    assert read == total, (read, total)
    print(f"{gib:g} GiB multipart ({n - 1} parts of {part_mib} MiB): parts {total / t_parts / 1e6:.0f} MB/s, "
          f"with complete {total / t_put / 1e6:.0f} MB/s; GET {total / t_get / 1e6:.0f} MB/s; gateway peak RSS "
          f"{base:.0f} MiB before, {after_put:.0f} MiB after the upload, {_vm_hwm_mib(gw.proc.pid):.0f} MiB after "
          "the GET")
    gw.s3.delete_object(Bucket="bench", Key="big")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256, help="MiB written and read per object size")
    ap.add_argument("--sizes", default="1,4,16,64", help="object sizes in MiB")
    ap.add_argument("--clients", type=int, default=4, help="concurrent connections")
    ap.add_argument("--small", type=int, default=2000, help="4 KiB objects")
    ap.add_argument("--storage", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--nginx-workers", type=int, default=1, help="1: one process, like one gateway")
    ap.add_argument("--gateway-workers", type=int, default=1, help="gateway processes (threefs s3 serve --workers)")
    ap.add_argument("--big-gib", type=float, default=0, help="only a multipart upload of this many GiB "
                    "(peak gateway RSS); the issue's figure is 5")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="s3bench-")
    print(f"load average before: {open('/proc/loadavg').read().strip()}")
    nginx = Nginx(tmp, args.nginx_workers)
    try:
        with local_cluster(tmp, args.storage, args.replicas, fuse=False) as (cluster, _):
            gw = Gateway(cluster, tmp, args.gateway_workers)
            try:
                if args.big_gib:
                    big_upload(gw, args.big_gib)
                    return
                rows = []
                for mib in [int(x) for x in args.sizes.split(",")]:
                    size = mib * MiB
                    res = {n: bench_size(n, s, size, args.mib * MiB, args.clients)
                           for n, s in (("threefs", gw), ("nginx", nginx))}
                    rows.append((f"{mib} MiB", res))
                    print(_row(f"{mib} MiB objects (MB/s)", res), flush=True)
                res = {}
                for n, s in (("threefs", gw), ("nginx", nginx)):
                    keys = [f"small/{i}" for i in range(args.small)]
                    body = os.urandom(4096)
                    put = _run([("PUT", s.url(k, "PUT")) for k in keys], args.clients * 2, body, 4096)
                    get = _run([("GET", s.url(k)) for k in keys], args.clients * 2, None, 4096)
                    res[n] = (args.small / put, args.small / get)
                print(_row("4 KiB objects (ops/s)", res))
            finally:
                gw.stop()
    finally:
        nginx.stop()
        if os.environ.get("THREEFS_BENCH_KEEP"):
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"load average after: {open('/proc/loadavg').read().strip()}")


def _row(label: str, res: dict) -> str:
    (tp, tg), (np_, ng) = res["threefs"], res["nginx"]
    return (f"{label:26s} PUT threefs {tp:9.1f}  nginx {np_:9.1f}  ratio {tp / np_:5.2f} | "
            f"GET threefs {tg:9.1f}  nginx {ng:9.1f}  ratio {tg / ng:5.2f}")


if __name__ == "__main__":
    main()
