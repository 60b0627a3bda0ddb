"""Cross-origin resource sharing for buckets (PutBucketCors, GetBucketCors, DeleteBucketCors, OPTIONS
preflights, and CORS headers on the answers to requests that carry an Origin), as S3 does it.

A configuration is up to 100 rules; a rule has AllowedOrigin (one `*` wildcard each at most),
AllowedMethod (GET, PUT, POST, DELETE, HEAD), AllowedHeader (`*` wildcards), ExposeHeader, MaxAgeSeconds
and an ID. The first rule that matches the request's origin, method and (for a preflight) every requested
header decides. A preflight with no matching rule, or on a bucket without a configuration, is refused
with 403 AccessForbidden, as S3 does.
"""

from __future__ import annotations

import re
from xml.sax.saxutils import escape

from threefs.s3.errors import S3Error
from threefs.s3.rules import _children, _local, _parse_xml, _text

RULES_MAX = 100
METHODS = ("GET", "PUT", "POST", "DELETE", "HEAD")
_FIELDS = (("AllowedOrigin", "origins"), ("AllowedMethod", "methods"), ("AllowedHeader", "headers"),
           ("ExposeHeader", "expose"))


def from_xml(body: bytes) -> list[dict]:
    root = _parse_xml(body)
    if _local(root.tag) != "CORSConfiguration":
        raise S3Error("MalformedXML", "the XML you provided did not validate against our published schema "
                      "(expected <CORSConfiguration>)")
    rules = []
    for node in _children(root, "CORSRule"):
        rule = {key: [(c.text or "").strip() for c in _children(node, tag)] for tag, key in _FIELDS}
        if not rule["origins"] or not rule["methods"]:
            raise S3Error("MalformedXML", "each CORSRule needs at least one AllowedOrigin and one AllowedMethod")
        for method in rule["methods"]:
            if method not in METHODS:
                raise S3Error("InvalidRequest", f"Found unsupported HTTP method in CORS config. Unsupported "
                              f"method is {method}")
        for origin in rule["origins"]:
            if origin.count("*") > 1:
                raise S3Error("InvalidRequest", f"AllowedOrigin {origin!r} can not have more than one "
                              "wildcard.")
        max_age = _text(node, "MaxAgeSeconds")
        if max_age is not None:
            if not max_age.strip().isdigit():
                raise S3Error("MalformedXML", f"MaxAgeSeconds must be a whole number of seconds, not "
                              f"{max_age!r}")
            rule["max_age"] = int(max_age)
        rule_id = _text(node, "ID")
        if rule_id is not None:
            rule["id"] = rule_id
        rules.append(rule)
    if not rules:
        raise S3Error("MalformedXML", "a CORSConfiguration needs at least one CORSRule")
    if len(rules) > RULES_MAX:
        raise S3Error("MalformedXML", f"a CORSConfiguration may have at most {RULES_MAX} rules")
    return rules


def to_xml(rules: list[dict]) -> bytes:
    out = []
    for rule in rules:
        parts = [f"<ID>{escape(rule['id'])}</ID>"] if "id" in rule else []
        for tag, key in _FIELDS:
            parts += [f"<{tag}>{escape(v)}</{tag}>" for v in rule.get(key, [])]
        if "max_age" in rule:
            parts.append(f"<MaxAgeSeconds>{rule['max_age']}</MaxAgeSeconds>")
        out.append("<CORSRule>" + "".join(parts) + "</CORSRule>")
    return ('<?xml version="1.0" encoding="UTF-8"?>\n<CORSConfiguration '
            'xmlns="http://s3.amazonaws.com/doc/2006-03-01/">' + "".join(out) + "</CORSConfiguration>").encode()


def _wild(pattern: str, value: str, case: bool) -> bool:
    """`*` matches any run of characters; nothing else is special."""
    if not case:
        pattern, value = pattern.lower(), value.lower()
    if "*" not in pattern:
        return pattern == value
    return re.fullmatch(".*".join(re.escape(p) for p in pattern.split("*")), value, re.S) is not None


def match(rules: list[dict], origin: str, method: str, headers: list[str] = ()) -> dict | None:
    for rule in rules:
        if method not in rule["methods"]:
            continue
        if not any(_wild(o, origin, case=True) for o in rule["origins"]):
            continue
        if all(any(_wild(h, want, case=False) for h in rule["headers"]) for want in headers):
            return rule
    return None


def response_headers(rule: dict, origin: str, preflight_headers: list[str] | None = None) -> dict:
    """The Access-Control-* headers a matching rule gives."""
    out = {"access-control-allow-origin": "*" if rule["origins"] == ["*"] else origin,
           "access-control-allow-methods": ", ".join(rule["methods"]),
           "vary": "Origin, Access-Control-Request-Headers, Access-Control-Request-Method"}
    if rule["origins"] != ["*"]:
        out["access-control-allow-credentials"] = "true"
    if preflight_headers:
        out["access-control-allow-headers"] = ", ".join(preflight_headers)
    if rule.get("expose"):
        out["access-control-expose-headers"] = ", ".join(rule["expose"])
    if "max_age" in rule:
        out["access-control-max-age"] = str(rule["max_age"])
    return out


def requested_headers(value: str) -> list[str]:
    return [h.strip().lower() for h in value.split(",") if h.strip()]
