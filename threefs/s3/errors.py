"""S3 errors: S3's codes, HTTP statuses and XML error bodies; threefs errors mapped onto them."""

from __future__ import annotations

from xml.sax.saxutils import escape

from threefs.common.status import StatusCode, ThreeFSError

STATUS_OF = {
    "AccessDenied": 403,
    "AuthorizationHeaderMalformed": 400,
    "AuthorizationQueryParametersError": 400,
    "BadDigest": 400,
    "BucketAlreadyExists": 409,
    "BucketAlreadyOwnedByYou": 409,
    "BucketNotEmpty": 409,
    "EntityTooLarge": 400,
    "EntityTooSmall": 400,
    "IncompleteBody": 400,
    "InternalError": 500,
    "InvalidAccessKeyId": 403,
    "InvalidArgument": 400,
    "InvalidBucketName": 400,
    "InvalidDigest": 400,
    "InvalidPart": 400,
    "InvalidPartOrder": 400,
    "InvalidRange": 416,
    "InvalidURI": 400,
    "MetadataTooLarge": 400,
    "InvalidPartNumber": 416,
    "InvalidRequest": 400,
    "InvalidStorageClass": 400,
    "InvalidTag": 400,
    "AccessForbidden": 403,
    "BadRequest": 400,
    "KeyTooLongError": 400,
    "MalformedXML": 400,
    "MalformedPOSTRequest": 400,
    "InvalidPolicyDocument": 400,
    "MethodNotAllowed": 405,
    "MissingContentLength": 411,
    "NoSuchBucket": 404,
    "NoSuchKey": 404,
    "NoSuchUpload": 404,
    "NotImplemented": 501,
    "NotModified": 304,
    "PreconditionFailed": 412,
    "RequestTimeTooSkewed": 403,
    "ServiceUnavailable": 503,
    "SignatureDoesNotMatch": 403,
    "XAmzContentSHA256Mismatch": 400,
    "InvalidChunkSizeError": 403,
    "NoSuchBucketPolicy": 404,
    "NoSuchLifecycleConfiguration": 404,
    "NoSuchCORSConfiguration": 404,
    "NoSuchTagSet": 404,
    "ServerSideEncryptionConfigurationNotFoundError": 404,
}


class S3Error(Exception):
    """An error answered as S3 does: status, code, message, and the resource it concerns."""

    def __init__(self, code: str, message: str, status: int | None = None, **extra: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.status = status or STATUS_OF.get(code, 400)
        self.extra = extra

    def xml(self, resource: str = "", request_id: str = "") -> bytes:
        fields = "".join(f"<{k}>{escape(str(v))}</{k}>" for k, v in self.extra.items())
        return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{self.code}</Code>'
                f"<Message>{escape(self.message)}</Message>{fields}<Resource>{escape(resource)}</Resource>"
                f"<RequestId>{request_id}</RequestId></Error>").encode("utf-8", "replace")


def from_threefs(e: ThreeFSError, what: str) -> S3Error:
    """A threefs error met while serving `what` (a bucket or key) -> the S3 error a client expects."""
    code = e.code
    if code in (StatusCode.PERMISSION_DENIED, StatusCode.NOT_PERMITTED):
        return S3Error("AccessDenied", f"threefs denies access to {what}: {e.message}")
    if code == StatusCode.NAME_TOO_LONG or code == StatusCode.INVALID_PATH:
        return S3Error("KeyTooLongError", f"{what} maps to a path threefs refuses: {e.message}")
    if code in (StatusCode.UNAVAILABLE, StatusCode.TIMEOUT, StatusCode.NO_SERVING_TARGET,
                StatusCode.TOO_MANY_REQUESTS, StatusCode.BUSY):
        return S3Error("ServiceUnavailable", f"threefs is unavailable: {e.message}", 503)
    if code == StatusCode.NO_SPACE:
        return S3Error("InternalError", f"threefs is out of space: {e.message}", 507)
    return S3Error("InternalError", f"threefs error on {what}: [{code.name}] {e.message}", 500)
