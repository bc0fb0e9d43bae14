"""KVSP problem types (spec: Error Handling, "KVSP Problem Types") and RFC 9457 problem details.

Every protocol error in the project is a :class:`Problem`. The HTTP edge renders one with
:func:`to_problem_json` and a client turns a received body back into the same class with
:func:`problem_from_json`, so ``except LeaseQuota`` works on both sides of the wire.

The spec's nine types carry ``type = "https://iana.org/assignments/kvsp#<suffix>"``. Errors the spec does not
name (a malformed body, a forbidden role, a body that is too large) use ``type = "about:blank"`` as RFC 9457
section 4.2.1 prescribes, with the HTTP status title; docs/wire.md lists them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any, ClassVar

KVSP_TYPE_BASE = "https://iana.org/assignments/kvsp#"
PROBLEM_MEDIA_TYPE = "application/problem+json"
ABOUT_BLANK = "about:blank"


class Problem(Exception):
    """A protocol error: an HTTP status, an RFC 9457 type and a human-readable detail."""

    suffix: ClassVar[str | None] = None  # KVSP type suffix; None for about:blank problems
    status: ClassVar[int] = 500

    def __init__(self, detail: str = "", *, status: int | None = None, type_uri: str | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.retry_after_s = retry_after_s  # sent as Retry-After by the HTTP edge (kvsp_http/problem_response.py)
        if status is not None:
            self.status = status  # type: ignore[misc]  # instance override for generic problems
        self._type_uri = type_uri

    @property
    def type_uri(self) -> str:
        if self._type_uri is not None:
            return self._type_uri
        return KVSP_TYPE_BASE + self.suffix if self.suffix else ABOUT_BLANK

    @property
    def title(self) -> str:
        if self.suffix:
            return _KVSP_TITLES[self.suffix]
        try:
            return HTTPStatus(self.status).phrase
        except ValueError:
            return "Error"

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"type": self.type_uri, "title": self.title, "status": self.status}
        if self.detail:
            body["detail"] = self.detail
        return body

    def __str__(self) -> str:
        return f"{self.title}: {self.detail}" if self.detail else self.title

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.detail!r}, status={self.status})"


# -- The KVSP problem types (spec table "KVSP Problem Types") ------------------------------------------------


class NotFound(Problem):
    suffix = "kvsp-not-found"
    status = 404


class ScopeDenied(Problem):
    suffix = "kvsp-scope-denied"
    status = 403


class Incompatible(Problem):
    suffix = "kvsp-incompatible"
    status = 409


class LeaseQuota(Problem):
    suffix = "kvsp-lease-quota"
    status = 429


class StaleEpoch(Problem):
    suffix = "kvsp-stale-epoch"
    status = 409


class InvalidState(Problem):
    suffix = "kvsp-invalid-state"
    status = 409


class DigestMismatch(Problem):
    suffix = "kvsp-digest-mismatch"
    status = 422


class PlanConflict(Problem):
    suffix = "kvsp-plan-conflict"
    status = 409


class LayersUnavailable(Problem):
    suffix = "kvsp-layers-unavailable"
    status = 404


_KVSP_TITLES = {
    "kvsp-not-found": "Block, lease, session, or directive unknown",
    "kvsp-scope-denied": "Client not authorized for the scope",
    "kvsp-incompatible": "Compatibility ID mismatch",
    "kvsp-lease-quota": "Lease quota exceeded",
    "kvsp-stale-epoch": "Epoch older than current",
    "kvsp-invalid-state": "Operation not allowed in the instance state",
    "kvsp-digest-mismatch": "Stored data does not match its digest",
    "kvsp-plan-conflict": "Reshard plan does not match the current map version",
    "kvsp-layers-unavailable": "Requested layers not held",
}

KVSP_PROBLEMS: dict[str, type[Problem]] = {
    cls.suffix: cls
    for cls in (
        NotFound,
        ScopeDenied,
        Incompatible,
        LeaseQuota,
        StaleEpoch,
        InvalidState,
        DigestMismatch,
        PlanConflict,
        LayersUnavailable,
    )
    if cls.suffix
}


# -- Problems the spec does not name: type about:blank ------------------------------------------------------


class BadRequest(Problem):
    """The request is malformed: bad JSON, a record that fails validation, a bad query parameter."""

    status = 400


class Forbidden(Problem):
    """The authenticated identity lacks the role a resource requires (scope violations are ScopeDenied)."""

    status = 403


class NoSuchResource(Problem):
    """No resource at this path (about:blank); an unknown block, lease or session is :class:`NotFound`."""

    status = 404


class NotAcceptable(Problem):
    """``codec=n`` names a codec the replica is not stored in and the holder does not transcode."""

    status = 406


class PreconditionFailed(Problem):
    status = 412


class ContentTooLarge(Problem):
    status = 413


class UnsupportedMediaType(Problem):
    status = 415


class PreconditionRequired(Problem):
    """A PUT of a block without ``If-None-Match: *`` (RFC 6585)."""

    status = 428


class TooManyRequests(Problem):
    status = 429


class Unavailable(Problem):
    status = 503


class InsufficientStorage(Problem):
    """No tier can take the block without evicting leased replicas, or the block is larger than every tier."""

    status = 507


_GENERIC_BY_STATUS: dict[int, type[Problem]] = {
    cls.status: cls
    for cls in (BadRequest, Forbidden, NoSuchResource, NotAcceptable, PreconditionFailed, ContentTooLarge,
                UnsupportedMediaType, PreconditionRequired, TooManyRequests, Unavailable, InsufficientStorage)
}


def to_problem_json(problem: Problem) -> tuple[int, bytes]:
    """The status and ``application/problem+json`` body for *problem*."""
    return problem.status, json.dumps(problem.to_json(), separators=(",", ":")).encode()


def problem_from_json(status: int, body: bytes | str | Mapping[str, Any]) -> Problem:
    """Turn a received problem document back into its exception class.

    A KVSP type URI gives its class; ``about:blank`` (or an unparseable body) gives the generic class for the
    status; any other type URI gives a plain :class:`Problem` that keeps the URI and status.
    """
    obj: Any = body
    if isinstance(body, bytes | str):
        try:
            obj = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nesting too deep
            obj = {}
    if not isinstance(obj, Mapping):
        obj = {}
    detail = obj.get("detail")
    detail = detail if isinstance(detail, str) else ""
    type_uri = obj.get("type", ABOUT_BLANK)
    type_uri = type_uri if isinstance(type_uri, str) else ABOUT_BLANK
    if type_uri.startswith(KVSP_TYPE_BASE):
        cls = KVSP_PROBLEMS.get(type_uri[len(KVSP_TYPE_BASE):])
        if cls is not None:
            return cls(detail) if cls.status == status else cls(detail, status=status)
    if type_uri == ABOUT_BLANK:
        generic = _GENERIC_BY_STATUS.get(status)
        if generic is not None:
            return generic(detail)
        return Problem(detail, status=status)
    return Problem(detail, status=status, type_uri=type_uri)
