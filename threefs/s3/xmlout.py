"""S3's XML response bodies."""

from __future__ import annotations

from urllib.parse import quote
from xml.sax.saxutils import escape

from threefs.s3.http import iso_date

NS = 'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'
HEAD = '<?xml version="1.0" encoding="UTF-8"?>\n'


def _enc(text: str, url: bool) -> str:
    return escape(quote(text, safe="/") if url else text)


def owner(cred_uid: int, name: str) -> str:
    return f"<Owner><ID>{cred_uid}</ID><DisplayName>{escape(name)}</DisplayName></Owner>"


def list_buckets(buckets: list, uid: int, name: str) -> bytes:
    items = "".join(f"<Bucket><Name>{escape(b)}</Name><CreationDate>{iso_date(t)}</CreationDate></Bucket>"
                    for b, t in buckets)
    return (f"{HEAD}<ListAllMyBucketsResult {NS}>{owner(uid, name)}<Buckets>{items}</Buckets>"
            "</ListAllMyBucketsResult>").encode()


def _contents(page, url: bool, with_owner: bool, own: str) -> str:
    return "".join(
        f"<Contents><Key>{_enc(k, url)}</Key><LastModified>{iso_date(t)}</LastModified>"
        f"<ETag>&quot;{etag}&quot;</ETag><Size>{size}</Size>{own if with_owner else ''}"
        "<StorageClass>STANDARD</StorageClass></Contents>" for k, size, t, etag in page.contents)


def _prefixes(page, url: bool) -> str:
    return "".join(f"<CommonPrefixes><Prefix>{_enc(p, url)}</Prefix></CommonPrefixes>" for p in page.prefixes)


def list_v2(bucket, page, prefix, delimiter, max_keys, url, start_after, token, next_token, fetch_owner,
            own) -> bytes:
    parts = [f"{HEAD}<ListBucketResult {NS}><Name>{escape(bucket)}</Name><Prefix>{_enc(prefix, url)}</Prefix>",
             f"<KeyCount>{len(page.contents) + len(page.prefixes)}</KeyCount><MaxKeys>{max_keys}</MaxKeys>"]
    if delimiter:
        parts.append(f"<Delimiter>{_enc(delimiter, url)}</Delimiter>")
    if url:
        parts.append("<EncodingType>url</EncodingType>")
    parts.append(f"<IsTruncated>{'true' if page.truncated else 'false'}</IsTruncated>")
    if start_after:
        parts.append(f"<StartAfter>{_enc(start_after, url)}</StartAfter>")
    if token is not None:
        parts.append(f"<ContinuationToken>{escape(token)}</ContinuationToken>")
    if page.truncated:
        parts.append(f"<NextContinuationToken>{escape(next_token)}</NextContinuationToken>")
    parts.append(_contents(page, url, fetch_owner, own) + _prefixes(page, url) + "</ListBucketResult>")
    return "".join(parts).encode()


def list_v1(bucket, page, prefix, delimiter, max_keys, url, marker, own) -> bytes:
    parts = [f"{HEAD}<ListBucketResult {NS}><Name>{escape(bucket)}</Name><Prefix>{_enc(prefix, url)}</Prefix>",
             f"<Marker>{_enc(marker, url)}</Marker><MaxKeys>{max_keys}</MaxKeys>"]
    if delimiter:
        parts.append(f"<Delimiter>{_enc(delimiter, url)}</Delimiter>")
    if url:
        parts.append("<EncodingType>url</EncodingType>")
    parts.append(f"<IsTruncated>{'true' if page.truncated else 'false'}</IsTruncated>")
    if page.truncated:
        parts.append(f"<NextMarker>{_enc(page.last, url)}</NextMarker>")
    parts.append(_contents(page, url, True, own) + _prefixes(page, url) + "</ListBucketResult>")
    return "".join(parts).encode()


def copy_result(tag: str, etag: str, mtime: float) -> bytes:
    return (f"{HEAD}<{tag} {NS}><LastModified>{iso_date(mtime)}</LastModified>"
            f"<ETag>&quot;{etag}&quot;</ETag></{tag}>").encode()


def delete_result(deleted: list[str], errors: list[tuple[str, str, str]], quiet: bool) -> bytes:
    d = "" if quiet else "".join(f"<Deleted><Key>{escape(k)}</Key></Deleted>" for k in deleted)
    e = "".join(f"<Error><Key>{escape(k)}</Key><Code>{c}</Code><Message>{escape(m)}</Message></Error>"
                for k, c, m in errors)
    return f"{HEAD}<DeleteResult {NS}>{d}{e}</DeleteResult>".encode()


def simple(tag: str, inner: str = "") -> bytes:
    return f"{HEAD}<{tag} {NS}>{inner}</{tag}>".encode()
