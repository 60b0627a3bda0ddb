"""Browser uploads: POST to a bucket with a multipart/form-data body and a signed policy.

The form's fields (key, policy, signature, metadata, ...) come first and are small; the `file` field
comes last and is streamed into the object like a PUT body. The policy (base64 JSON) is checked as S3
does: signature (SigV4: hex HMAC of the policy with the signing key; SigV2: base64 HMAC-SHA1), expiry,
every field covered by a condition, every condition met, content-length-range.
"""

from __future__ import annotations

import base64
import calendar
import hashlib
import hmac
import json
import time

from threefs.s3 import sigv4
from threefs.s3.errors import S3Error

FIELDS_BYTES_MAX = 1 << 20  # everything before the file
# fields a policy need not name (signature fields; S3 wants the SigV4 ones named, boto3 names them)
EXEMPT = {"policy", "x-amz-signature", "signature", "awsaccesskeyid", "file", "bucket", "x-amz-credential",
          "x-amz-algorithm", "x-amz-date", "x-amz-security-token"}


class FormReader:
    """Splits a multipart/form-data stream: fields() gives the fields before `file` (and its
    filename and content type); file_body() then yields the file's bytes."""

    def __init__(self, chunks, boundary: str):
        self.chunks = chunks.__aiter__()
        self.delim = b"\r\n--" + boundary.encode("latin-1")
        self.buf = bytearray(b"\r\n")  # the first boundary has no CRLF before it
        self.eof = False

    async def _more(self) -> bool:
        if self.eof:
            return False
        try:
            self.buf += await self.chunks.__anext__()
            return True
        except StopAsyncIteration:
            self.eof = True
            return False

    async def _until(self, marker: bytes, limit: int) -> bytes:
        while (i := self.buf.find(marker)) < 0:
            if len(self.buf) > limit or not await self._more():
                raise S3Error("MalformedPOSTRequest", "the body of your POST request is not well-formed "
                              "multipart/form-data")
        out = bytes(self.buf[:i])
        del self.buf[:i + len(marker)]
        return out

    async def fields(self) -> tuple[dict[str, str], str, str]:
        await self._until(self.delim, FIELDS_BYTES_MAX)
        fields: dict[str, str] = {}
        while True:
            head = await self._until(b"\r\n\r\n", FIELDS_BYTES_MAX)
            if head.startswith(b"--"):
                raise S3Error("InvalidArgument", "POST requires exactly one file upload per request",
                              ArgumentName="file")
            name, filename, ctype = _part_head(head.lstrip(b"\r\n").decode("utf-8", "replace"))
            if name.lower() == "file":
                return fields, filename, ctype
            fields[name] = (await self._until(self.delim, FIELDS_BYTES_MAX)).decode("utf-8", "replace")

    async def file_body(self):
        keep = len(self.delim)
        while True:
            i = self.buf.find(self.delim)
            if i >= 0:
                if i:
                    yield bytes(self.buf[:i])
                return  # what follows (the closing boundary, other fields) is ignored, as S3 does
            if len(self.buf) > keep:
                out = bytes(self.buf[:-keep])
                del self.buf[:-keep]
                yield out
            if not await self._more():
                raise S3Error("IncompleteBody", "the POST body ended inside the file")


def _part_head(text: str) -> tuple[str, str, str]:
    name = filename = ctype = ""
    for line in text.split("\r\n"):
        k, _, v = line.partition(":")
        if k.strip().lower() == "content-disposition":
            for item in v.split(";"):
                ik, _, iv = item.strip().partition("=")
                iv = iv.strip().strip('"')
                if ik == "name":
                    name = iv
                elif ik == "filename":
                    filename = iv
        elif k.strip().lower() == "content-type":
            ctype = v.strip()
    return name, filename, ctype


def check_policy(fields: dict[str, str], bucket: str, secret_of, now: float | None = None) -> tuple[str, list]:
    """Verify the form's signature and policy; returns (access key, content-length-range or [])."""
    now = time.time() if now is None else now
    f = {k.lower(): v for k, v in fields.items()}
    policy_b64 = f.get("policy")
    if policy_b64 is None:
        raise S3Error("AccessDenied", "anonymous POST uploads are not allowed: sign a policy")
    if "x-amz-signature" in f:
        access_key, date, region, service = sigv4._parse_credential(f.get("x-amz-credential", ""))
        key = sigv4.signing_key(secret_of(access_key), date, region, service)
        want = hmac.new(key, policy_b64.encode(), hashlib.sha256).hexdigest()
        sent = f["x-amz-signature"]
    elif "signature" in f and "awsaccesskeyid" in f:
        access_key = f["awsaccesskeyid"]
        want = base64.b64encode(hmac.new(secret_of(access_key).encode(), policy_b64.encode(),
                                         hashlib.sha1).digest()).decode()
        sent = f["signature"]
    else:
        raise S3Error("InvalidArgument", "a POST with a policy needs its signature fields")
    if not hmac.compare_digest(want, sent):
        raise S3Error("SignatureDoesNotMatch", "the POST policy's signature does not match",
                      AWSAccessKeyId=access_key)
    try:
        policy = json.loads(base64.b64decode(policy_b64))
        expires = calendar.timegm(time.strptime(policy["expiration"].split(".")[0].rstrip("Z"), "%Y-%m-%dT%H:%M:%S"))
        conditions = policy["conditions"]
    except (ValueError, KeyError, TypeError):
        raise S3Error("InvalidPolicyDocument", "the POST policy is not valid JSON with expiration and "
                      "conditions") from None
    if now > expires:
        raise S3Error("AccessDenied", "Invalid according to Policy: Policy expired.")
    return access_key, _check_conditions(conditions, dict(f, bucket=bucket))


def _check_conditions(conditions: list, f: dict[str, str]) -> list:
    covered, length_range = {"bucket"}, []
    for c in conditions:
        if isinstance(c, dict) and len(c) == 1:
            (k, v), = c.items()
            op, name, value = "eq", k.lower(), v
        elif isinstance(c, list) and len(c) == 3 and c[0] == "content-length-range":
            length_range = [int(c[1]), int(c[2])]
            continue
        elif isinstance(c, list) and len(c) == 3 and isinstance(c[1], str) and c[1].startswith("$"):
            op, name, value = str(c[0]).lower(), c[1][1:].lower(), c[2]
        else:
            raise S3Error("InvalidPolicyDocument", f"invalid policy condition {c!r}")
        covered.add(name)
        have = f.get(name, "")
        ok = have == value if op == "eq" else have.startswith(value) if op == "starts-with" else None
        if ok is None:
            raise S3Error("InvalidPolicyDocument", f"unknown policy operation {op!r}")
        if not ok:
            raise S3Error("AccessDenied", f"Invalid according to Policy: Policy Condition failed: "
                          f"[\"{op}\", \"${name}\", \"{value}\"]")
    extra = [k for k in f if k not in covered and k not in EXEMPT and not k.startswith("x-ignore-")]
    if extra:
        raise S3Error("AccessDenied", f"Invalid according to Policy: Extra input fields: {', '.join(extra)}")
    return length_range
