"""Request rules shared by the handlers: conditions (RFC 7232 as S3 applies them), ranges, copy
sources, object headers, request XML. Pure functions."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from urllib.parse import unquote

from threefs.s3.errors import S3Error
from threefs.s3.http import Request, http_date, parse_http_date


def _object_headers(info) -> dict:
    r = info.record
    headers = {"etag": f'"{info.etag}"', "last-modified": http_date(info.mtime),
               "content-type": r.get("ct", "binary/octet-stream"), "accept-ranges": "bytes"}
    headers.update(r.get("h", {}))
    for k, v in (r.get("meta") or {}).items():
        headers["x-amz-meta-" + k] = v
    if r.get("tags"):
        headers["x-amz-tagging-count"] = str(len(r["tags"]))
    return headers


def _etag_matches(header: str, etag: str) -> bool:
    return any(t.strip() in ("*", f'"{etag}"', etag) for t in header.split(","))


def _check_conditions(req: Request, info, headers: dict) -> None:
    """RFC 7232 as S3 applies it: If-Match / If-Unmodified-Since -> 412; If-None-Match /
    If-Modified-Since -> 304 (412 for the former on writes is handled by the writers)."""
    mtime = int(info.mtime)
    im, inm = req.header("if-match"), req.header("if-none-match")
    ims, ius = req.header("if-modified-since"), req.header("if-unmodified-since")
    if im and not _etag_matches(im, info.etag):
        raise S3Error("PreconditionFailed", "At least one of the pre-conditions you specified did not hold",
                      Condition="If-Match")
    if ius and not im:
        t = parse_http_date(ius)
        if t is not None and mtime > t:
            raise S3Error("PreconditionFailed", "At least one of the pre-conditions you specified did not "
                          "hold", Condition="If-Unmodified-Since")
    not_modified = {"etag": headers["etag"], "last-modified": headers["last-modified"]}
    if inm and _etag_matches(inm, info.etag):
        raise S3Error("NotModified", "not modified", 304, **not_modified)
    if ims and not inm:
        t = parse_http_date(ims)
        if t is not None and mtime <= t:
            raise S3Error("NotModified", "not modified", 304, **not_modified)


def _check_copy_conditions(req: Request, src) -> None:
    mtime = int(src.mtime)
    im, inm = req.header("x-amz-copy-source-if-match"), req.header("x-amz-copy-source-if-none-match")
    ims = req.header("x-amz-copy-source-if-modified-since")
    ius = req.header("x-amz-copy-source-if-unmodified-since")
    failed = (im and not _etag_matches(im, src.etag)) or (inm and _etag_matches(inm, src.etag))
    if not failed and ius and not im:
        t = parse_http_date(ius)
        failed = t is not None and mtime > t
    if not failed and ims and not inm:
        t = parse_http_date(ims)
        failed = t is not None and mtime <= t
    if failed:
        raise S3Error("PreconditionFailed", "At least one of the pre-conditions you specified did not hold")


def _copy_source(text: str) -> tuple[str, str]:
    src = unquote(text.split("?versionId=", 1)[0])
    src = src[1:] if src.startswith("/") else src
    bucket, _, key = src.partition("/")
    if not bucket or not key:
        raise S3Error("InvalidArgument", "x-amz-copy-source must be BUCKET/KEY", ArgumentName="x-amz-copy-source")
    return bucket, key


def _parse_range(text: str, size: int) -> tuple[int | None, int | None]:
    """A single `bytes=` range -> [start, end); (None, None) to ignore it (serve the whole object)."""
    if not text.startswith("bytes=") or "," in text:
        return None, None
    first, _, last = text[6:].strip().partition("-")
    try:
        if first == "":
            n = int(last)
            if n == 0:
                raise S3Error("InvalidRange", "the requested range is not satisfiable", size=size,
                              ActualObjectSize=str(size), RangeRequested=text)
            return max(0, size - n), size
        start = int(first)
        end = int(last) + 1 if last else size
    except ValueError:
        return None, None
    if end <= start and last:
        return None, None
    if start >= size:
        raise S3Error("InvalidRange", "the requested range is not satisfiable", size=size,
                      ActualObjectSize=str(size), RangeRequested=text)
    return start, min(end, size)


def _part_range(info, text: str) -> str:
    parts = info.record.get("parts") or [info.size]
    if not text.isdigit() or not 1 <= int(text) <= len(parts):
        raise S3Error("InvalidPartNumber", "the requested partnumber is not satisfiable", 416)
    n = int(text)
    start = sum(parts[:n - 1])
    return f"bytes={start}-{start + parts[n - 1] - 1}"


def _parse_xml(body: bytes):
    try:
        return ET.fromstring(body)
    except ET.ParseError:
        raise S3Error("MalformedXML", "the XML you provided was not well-formed") from None


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _children(root, name: str) -> list:
    return [c for c in root if _local(c.tag) == name]


def _text(node, name: str) -> str | None:
    for c in node:
        if _local(c.tag) == name:
            return c.text or ""
    return None
