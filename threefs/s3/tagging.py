"""Object and bucket tags (S3's PutObjectTagging, GetObjectTagging, DeleteObjectTagging, and `x-amz-tagging` on
PutObject, CreateMultipartUpload and CopyObject): parsing and S3's limits.

Bucket tags (Put/Get/DeleteBucketTagging, up to 50) are a bucket configuration record (store.py).
Object tags live in the object's metadata record (`"tags": [[key, value], ...]`, in the order given), so they
move and vanish with the object. S3's limits: at most 10 tags per object, keys of 1–128 and values of
0–256 Unicode characters, no key twice, keys not starting with `aws:` (reserved); anything else is
InvalidTag (400) with a message that names the offending tag.
"""

from __future__ import annotations

from urllib.parse import parse_qsl
from xml.sax.saxutils import escape

from threefs.s3.errors import S3Error
from threefs.s3.rules import _children, _local, _parse_xml, _text

TAGS_MAX = 10
KEY_CHARS_MAX = 128
VALUE_CHARS_MAX = 256


def check(tags: list[tuple[str, str]], limit: int = TAGS_MAX) -> list[list[str]]:
    if len(tags) > limit:
        raise S3Error("InvalidTag", f"Object tags cannot be greater than {limit}: {len(tags)} given")
    seen = set()
    for key, value in tags:
        if not 1 <= len(key) <= KEY_CHARS_MAX:
            raise S3Error("InvalidTag", f"The TagKey you have provided is invalid: a key has 1 to "
                          f"{KEY_CHARS_MAX} characters, this one {len(key)}")
        if len(value) > VALUE_CHARS_MAX:
            raise S3Error("InvalidTag", f"The TagValue you have provided is invalid: a value has at most "
                          f"{VALUE_CHARS_MAX} characters, the one of {key!r} has {len(value)}")
        if key.lower().startswith("aws:"):
            raise S3Error("InvalidTag", f"Your TagKey cannot be prefixed with aws: ({key!r})")
        if key in seen:
            raise S3Error("InvalidTag", f"Cannot provide multiple Tags with the same key ({key!r})")
        seen.add(key)
    return [[k, v] for k, v in tags]


def from_header(value: str) -> list[list[str]]:
    """`x-amz-tagging: k1=v1&k2=v2` (URL-encoded, as a query string)."""
    try:
        pairs = parse_qsl(value, keep_blank_values=True, strict_parsing=bool(value))
    except ValueError:
        raise S3Error("InvalidArgument", "The header 'x-amz-tagging' shall be encoded as UTF-8 then "
                      "URLEncoded URL query parameters without tag name duplicates",
                      ArgumentName="x-amz-tagging", ArgumentValue=value) from None
    return check(pairs)


def from_xml(body: bytes, limit: int = TAGS_MAX) -> list[list[str]]:
    """A PutObjectTagging body: <Tagging><TagSet><Tag><Key/><Value/></Tag>...</TagSet></Tagging>."""
    root = _parse_xml(body)
    if _local(root.tag) != "Tagging":
        raise S3Error("MalformedXML", "the XML you provided was not well-formed or did not validate "
                      "against our published schema (expected <Tagging>)")
    sets = _children(root, "TagSet")
    if len(sets) != 1:
        raise S3Error("MalformedXML", "<Tagging> needs exactly one <TagSet>")
    tags = []
    for tag in _children(sets[0], "Tag"):
        key, value = _text(tag, "Key"), _text(tag, "Value")
        if key is None or value is None:
            raise S3Error("MalformedXML", "each <Tag> needs a <Key> and a <Value>")
        tags.append((key, value))
    return check(tags, limit)


def to_xml(tags: list) -> bytes:
    items = "".join(f"<Tag><Key>{escape(k)}</Key><Value>{escape(v)}</Value></Tag>" for k, v in tags)
    return ('<?xml version="1.0" encoding="UTF-8"?>\n<Tagging xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<TagSet>{items}</TagSet></Tagging>").encode()
