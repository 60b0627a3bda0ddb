"""Bucket lifecycle: S3's Put/Get/DeleteBucketLifecycleConfiguration, and the expiry they ask for, carried
out by the gateways.

Rules, as S3's: an ID (≤ 255 characters, unique), Status Enabled/Disabled, a filter (Prefix, one Tag,
ObjectSizeGreaterThan/LessThan, or an And of those; the legacy rule-level Prefix too) and actions:
- Expiration Days N: an object expires at the first midnight UTC at least N days after it was last
  written (S3's rounding); Expiration Date: at that midnight UTC;
- AbortIncompleteMultipartUpload DaysAfterInitiation N: uploads started N days ago are aborted;
- NoncurrentVersionExpiration and ExpiredObjectDeleteMarker are accepted and have nothing to do
  (buckets are never versioned). Transitions are refused: threefs has no storage classes.

Every gateway runs the expiry pass (`sweep`) every LIFECYCLE_INTERVAL_S (an hour;
$THREEFS_S3_LIFECYCLE_INTERVAL_S); passes of several gateways at once only repeat deletes. An object is
looked at again just before it is deleted, so one replaced meanwhile by a newer PUT is kept.
"""

from __future__ import annotations

import calendar
import datetime
import logging
import os
from xml.sax.saxutils import escape

from threefs.s3.errors import S3Error
from threefs.s3.rules import _children, _local, _parse_xml, _text

log = logging.getLogger("threefs.s3.lifecycle")
RULES_MAX = 1000
ID_CHARS_MAX = 255
DAY_S = 86400
LIFECYCLE_INTERVAL_S = float(os.environ.get("THREEFS_S3_LIFECYCLE_INTERVAL_S", "3600"))


def _positive(text: str | None, what: str) -> int:
    if text is None or not text.strip().isdigit() or int(text) <= 0:
        raise S3Error("InvalidArgument", f"'{what}' must be a positive integer, not {text!r}")
    return int(text)


def _date(text: str) -> int:
    try:
        when = datetime.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise S3Error("InvalidArgument", f"'Date' must be an ISO 8601 date, not {text!r}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    when = when.astimezone(datetime.timezone.utc)
    if (when.hour, when.minute, when.second, when.microsecond) != (0, 0, 0, 0):
        raise S3Error("InvalidArgument", f"'Date' must be at midnight GMT ({text!r} is not)")
    return calendar.timegm(when.timetuple())


def _filter(node, rule: dict) -> None:
    """A <Filter>: Prefix, Tag, sizes, or And of them."""
    parts = [c for c in node]
    if len(parts) > 1:
        raise S3Error("MalformedXML", "a lifecycle Filter holds one condition; use <And> for several")
    for part in parts:
        tag = _local(part.tag)
        if tag == "And":
            for c in part:
                _condition(c, rule)
        else:
            _condition(part, rule)


def _condition(node, rule: dict) -> None:
    tag = _local(node.tag)
    if tag == "Prefix":
        rule["prefix"] = node.text or ""
    elif tag == "Tag":
        key, value = _text(node, "Key"), _text(node, "Value")
        if key is None or value is None:
            raise S3Error("MalformedXML", "a lifecycle Tag needs a Key and a Value")
        rule.setdefault("tags", []).append([key, value])
    elif tag == "ObjectSizeGreaterThan":
        rule["size_gt"] = int((node.text or "0").strip() or 0)
    elif tag == "ObjectSizeLessThan":
        rule["size_lt"] = _positive(node.text, "ObjectSizeLessThan")
    else:
        raise S3Error("MalformedXML", f"unknown lifecycle filter element <{tag}>")


def from_xml(body: bytes) -> list[dict]:
    root = _parse_xml(body)
    if _local(root.tag) != "LifecycleConfiguration":
        raise S3Error("MalformedXML", "expected <LifecycleConfiguration>")
    rules, ids = [], set()
    for node in _children(root, "Rule"):
        rule: dict = {"prefix": ""}
        rid = _text(node, "ID")
        if rid is not None:
            if len(rid) > ID_CHARS_MAX:
                raise S3Error("InvalidArgument", f"a lifecycle rule ID has at most {ID_CHARS_MAX} characters")
            if rid in ids:
                raise S3Error("InvalidArgument", f"rule ID {rid!r} is used twice; IDs must be unique")
            ids.add(rid)
            rule["id"] = rid
        status = _text(node, "Status")
        if status not in ("Enabled", "Disabled"):
            raise S3Error("MalformedXML", f"a lifecycle rule's Status is Enabled or Disabled, not {status!r}")
        rule["status"] = status
        if _text(node, "Prefix") is not None:
            rule["prefix"] = _text(node, "Prefix")
        for f in _children(node, "Filter"):
            _filter(f, rule)
        if _children(node, "Transition") or _children(node, "NoncurrentVersionTransition"):
            raise S3Error("NotImplemented", "lifecycle transitions need storage classes, which threefs does "
                          "not have", 501)
        acted = False
        for exp in _children(node, "Expiration"):
            days, date, marker = _text(exp, "Days"), _text(exp, "Date"), _text(exp, "ExpiredObjectDeleteMarker")
            if sum(x is not None for x in (days, date, marker)) != 1:
                raise S3Error("MalformedXML", "an Expiration gives exactly one of Days, Date and "
                              "ExpiredObjectDeleteMarker")
            if days is not None:
                rule["days"] = _positive(days, "Days")
            elif date is not None:
                rule["date"] = _date(date)
            else:
                rule["delete_marker"] = marker.strip().lower() == "true"
            acted = True
        for ab in _children(node, "AbortIncompleteMultipartUpload"):
            rule["abort_days"] = _positive(_text(ab, "DaysAfterInitiation"), "DaysAfterInitiation")
            acted = True
        for nc in _children(node, "NoncurrentVersionExpiration"):
            rule["noncurrent_days"] = _positive(_text(nc, "NoncurrentDays"), "NoncurrentDays")
            acted = True
        if not acted:
            raise S3Error("MalformedXML", "a lifecycle rule needs at least one action")
        rules.append(rule)
    if not rules:
        raise S3Error("MalformedXML", "a LifecycleConfiguration needs at least one Rule")
    if len(rules) > RULES_MAX:
        raise S3Error("MalformedXML", f"at most {RULES_MAX} lifecycle rules")
    return rules


def to_xml(rules: list[dict]) -> bytes:
    out = []
    for r in rules:
        conds = [f"<Prefix>{escape(r['prefix'])}</Prefix>"] if r.get("prefix") else []
        conds += [f"<Tag><Key>{escape(k)}</Key><Value>{escape(v)}</Value></Tag>" for k, v in r.get("tags", [])]
        if "size_gt" in r:
            conds.append(f"<ObjectSizeGreaterThan>{r['size_gt']}</ObjectSizeGreaterThan>")
        if "size_lt" in r:
            conds.append(f"<ObjectSizeLessThan>{r['size_lt']}</ObjectSizeLessThan>")
        if len(conds) > 1:
            flt = "<Filter><And>" + "".join(conds) + "</And></Filter>"
        else:
            flt = "<Filter>" + "".join(conds) + "</Filter>"
        parts = [f"<ID>{escape(r['id'])}</ID>"] if "id" in r else []
        parts += [flt, f"<Status>{r['status']}</Status>"]
        if "days" in r:
            parts.append(f"<Expiration><Days>{r['days']}</Days></Expiration>")
        elif "date" in r:
            iso = datetime.datetime.fromtimestamp(r["date"], datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")
            parts.append(f"<Expiration><Date>{iso}</Date></Expiration>")
        elif "delete_marker" in r:
            flag = "true" if r["delete_marker"] else "false"
            parts.append(f"<Expiration><ExpiredObjectDeleteMarker>{flag}</ExpiredObjectDeleteMarker></Expiration>")
        if "noncurrent_days" in r:
            parts.append(f"<NoncurrentVersionExpiration><NoncurrentDays>{r['noncurrent_days']}</NoncurrentDays>"
                         "</NoncurrentVersionExpiration>")
        if "abort_days" in r:
            parts.append(f"<AbortIncompleteMultipartUpload><DaysAfterInitiation>{r['abort_days']}"
                         "</DaysAfterInitiation></AbortIncompleteMultipartUpload>")
        out.append("<Rule>" + "".join(parts) + "</Rule>")
    return ('<?xml version="1.0" encoding="UTF-8"?>\n<LifecycleConfiguration '
            'xmlns="http://s3.amazonaws.com/doc/2006-03-01/">' + "".join(out) + "</LifecycleConfiguration>").encode()


def expires_at(rule: dict, mtime_s: float) -> float | None:
    """When an object written at mtime_s expires under `rule` (None: never)."""
    if "days" in rule:
        return (int(mtime_s) // DAY_S + rule["days"] + (1 if int(mtime_s) % DAY_S else 0)) * DAY_S
    if "date" in rule:
        return float(rule["date"])
    return None


def applies(rule: dict, key: str, size: int, tags: list | None) -> bool:
    if rule["status"] != "Enabled" or not key.startswith(rule.get("prefix", "")):
        return False
    if "size_gt" in rule and not size > rule["size_gt"]:
        return False
    if "size_lt" in rule and not size < rule["size_lt"]:
        return False
    return all([k, v] in (tags or []) for k, v in rule.get("tags", []))


async def sweep(store, multipart, now: float) -> dict:
    """One expiry pass over every bucket with a lifecycle configuration; counts of what it did."""
    done = {"buckets": 0, "expired": 0, "aborted": 0}
    for bucket, _ in await store.list_buckets(None):
        try:
            _, rules = await store.bucket_config(bucket, "lifecycle", None)
        except S3Error:
            continue  # deleted meanwhile
        if not rules or not any(r["status"] == "Enabled" for r in rules):
            continue
        done["buckets"] += 1
        done["expired"] += await _expire_objects(store, bucket, rules, now)
        done["aborted"] += await _abort_uploads(multipart, bucket, rules, now)
    return done


async def _expire_objects(store, bucket: str, rules: list[dict], now: float) -> int:
    expiring = [r for r in rules if r["status"] == "Enabled" and ("days" in r or "date" in r)]
    if not expiring:
        return 0
    removed, after = 0, ""
    prefix = os.path.commonprefix([r.get("prefix", "") for r in expiring])
    while True:
        page = await store.list(bucket, None, prefix=prefix, start_after=after, max_keys=1000)
        for key, size, mtime_s, _ in page.contents:
            after = key
            if not any(key.startswith(r.get("prefix", "")) and expires_at(r, mtime_s) <= now for r in expiring):
                continue
            info = await store.head(bucket, key, None)  # again, with its tags: a newer PUT is kept
            tags = info.record.get("tags") or []
            if any(applies(r, key, info.size, tags) and expires_at(r, info.mtime) <= now for r in expiring):
                await store.delete(bucket, key, None)
                removed += 1
        if not page.truncated:
            return removed


async def _abort_uploads(multipart, bucket: str, rules: list[dict], now: float) -> int:
    aborting = [r for r in rules if r["status"] == "Enabled" and "abort_days" in r]
    aborted = 0
    if not aborting:
        return 0
    for key, upload_id, info in await multipart.uploads(bucket):
        if any(key.startswith(r.get("prefix", "")) and info["initiated"] + r["abort_days"] * DAY_S <= now
               for r in aborting):
            try:
                await multipart.abort(bucket, key, upload_id)
                aborted += 1
            except S3Error:
                pass  # completed or aborted meanwhile
    return aborted
