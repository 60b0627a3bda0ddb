"""S3 access control lists, mapped onto threefs's POSIX permissions, and anonymous access.

threefs decides what a key's user may do by POSIX modes (docs/s3.md "Keys and users"). S3's canned ACLs
map onto modes, so a bucket or object made private through S3 is private through FUSE too:

| canned ACL          | bucket directory | object file | anonymous requests may             |
|---------------------|------------------|-------------|------------------------------------|
| private             | 0700             | 0600        | nothing                            |
| authenticated-read  | 0755             | 0644        | nothing (other users' keys: read)   |
| public-read         | 0755             | 0644        | bucket: list; object: GET/HEAD     |
| public-read-write   | 0777             | 0666        | bucket: list, PUT, DELETE; object: read |

Anonymous access exists only where an S3 ACL granted it (public-read / public-read-write, remembered in
the bucket's "acl" configuration or the object's record): a directory or file that is merely world-readable
in POSIX terms is never served to an unsigned request. ACL bodies (AccessControlPolicy XML) are taken when
their grants are one of these canned forms; other grants (x-amz-grant-* headers, grants to other users)
are refused with NotImplemented, since POSIX modes cannot hold them.
"""

from __future__ import annotations

from xml.sax.saxutils import escape

from threefs.s3.errors import S3Error
from threefs.s3.rules import _children, _local, _parse_xml, _text

ALL_USERS = "http://acs.amazonaws.com/groups/global/AllUsers"
AUTHENTICATED_USERS = "http://acs.amazonaws.com/groups/global/AuthenticatedUsers"
BUCKET_MODES = {"private": 0o700, "authenticated-read": 0o755, "public-read": 0o755, "public-read-write": 0o777}
OBJECT_MODES = {"private": 0o600, "authenticated-read": 0o644, "public-read": 0o644, "public-read-write": 0o666,
                "bucket-owner-read": 0o600, "bucket-owner-full-control": 0o600}
PUBLIC = ("public-read", "public-read-write")
ANONYMOUS_UID = 65534


def _unsupported(what: str) -> S3Error:
    return S3Error("NotImplemented", f"{what}: threefs keeps permissions as POSIX modes, which hold the canned "
                   "ACLs private, authenticated-read, public-read and public-read-write (or the same grants "
                   "as an AccessControlPolicy), not grants to particular users", 501)


def canned(req, modes: dict) -> str | None:
    """The canned ACL a request asks for (x-amz-acl), None if none; grant headers are refused."""
    for h in req.headers:
        if h.startswith("x-amz-grant-"):
            raise _unsupported(f"the header {h}")
    name = req.header("x-amz-acl")
    if not name:
        return None
    if name not in modes:
        raise S3Error("InvalidArgument", f"x-amz-acl {name!r} is not one of {', '.join(sorted(modes))}",
                      ArgumentName="x-amz-acl", ArgumentValue=name)
    return name


def from_policy(body: bytes, owner_uid: int, modes: dict) -> str:
    """The canned ACL an AccessControlPolicy body amounts to."""
    root = _parse_xml(body)
    if _local(root.tag) != "AccessControlPolicy":
        raise S3Error("MalformedACLError", "The XML you provided was not well-formed or did not validate "
                      "against our published schema (expected <AccessControlPolicy>)")
    grants = set()
    for lst in _children(root, "AccessControlList"):
        for grant in _children(lst, "Grant"):
            grantee = next((c for c in grant if _local(c.tag) == "Grantee"), None)
            permission = _text(grant, "Permission") or ""
            if grantee is None:
                raise S3Error("MalformedACLError", "each Grant needs a Grantee")
            uri, ident = _text(grantee, "URI"), _text(grantee, "ID")
            if uri is not None:
                grants.add((uri.strip(), permission))
            elif ident is not None and ident.strip() == str(owner_uid):
                grants.add(("owner", permission))
            else:
                raise _unsupported("a grant to another user")
    if ("owner", "FULL_CONTROL") not in grants:
        raise _unsupported("an ACL without FULL_CONTROL for the owner")
    grants.discard(("owner", "FULL_CONTROL"))
    for name, wanted in (("private", set()), ("public-read", {(ALL_USERS, "READ")}),
                         ("public-read-write", {(ALL_USERS, "READ"), (ALL_USERS, "WRITE")}),
                         ("authenticated-read", {(AUTHENTICATED_USERS, "READ")})):
        if grants == wanted and name in modes:
            return name
    raise _unsupported("these grants")


def policy_xml(owner_uid: int, owner_name: str, mode: int, public: str | None, is_dir: bool) -> bytes:
    """GetBucketAcl / GetObjectAcl: the owner's FULL_CONTROL, and what others may, from the mode (and the
    public grant, which makes "others" everybody)."""
    readable = mode & (0o005 if is_dir else 0o004) == (0o005 if is_dir else 0o004)
    writable = mode & (0o003 if is_dir else 0o002) == (0o003 if is_dir else 0o002)
    group = ALL_USERS if public in PUBLIC else AUTHENTICATED_USERS
    o = f"<ID>{owner_uid}</ID><DisplayName>{escape(owner_name)}</DisplayName>"
    grants = [('<Grant><Grantee xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance" xsi:type="CanonicalUser">'
               f"{o}</Grantee><Permission>FULL_CONTROL</Permission></Grant>")]
    for ok, perm in ((readable, "READ"), (writable, "WRITE")):
        if ok:
            grants.append('<Grant><Grantee xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance" '
                          f'xsi:type="Group"><URI>{group}</URI></Grantee><Permission>{perm}</Permission></Grant>')
    return ('<?xml version="1.0" encoding="UTF-8"?>\n<AccessControlPolicy '
            f'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Owner>{o}</Owner><AccessControlList>'
            + "".join(grants) + "</AccessControlList></AccessControlPolicy>").encode()
