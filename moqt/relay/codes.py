"""Request error and PUBLISH_DONE codes across drafts 14 and 18: a relay answers each peer in its own draft,
whatever the draft of the upstream."""

from __future__ import annotations

from moqt.aio import MoqtRequestError, excessive_load_code
from moqt.errors import FetchErrorCode14, PublishDoneCode14, PublishDoneCode18, RequestErrorCode14, RequestErrorCode18
from moqt.relay.interfaces import Decision, NoUpstream, Verdict
from moqt.types import Draft


def _kind_of(draft: Draft | None, code: int) -> str:
    if draft is Draft.D14:
        table14 = {int(FetchErrorCode14.TRACK_DOES_NOT_EXIST): "does-not-exist",
                   int(FetchErrorCode14.INVALID_RANGE): "invalid-range",
                   int(RequestErrorCode14.NOT_SUPPORTED): "not-supported", int(RequestErrorCode14.TIMEOUT): "timeout"}
        return table14.get(code, "internal")
    table18 = {int(RequestErrorCode18.DOES_NOT_EXIST): "does-not-exist",
               int(RequestErrorCode18.INVALID_RANGE): "invalid-range",
               int(RequestErrorCode18.NOT_SUPPORTED): "not-supported", int(RequestErrorCode18.TIMEOUT): "timeout"}
    return table18.get(code, "internal")


def request_code(draft: Draft, kind: str) -> int:
    """The request error code of *kind* in *draft* (FETCH_ERROR / SUBSCRIBE_ERROR share them in draft 14)."""
    if kind == "excessive-load":  # draft 18 EXCESSIVE_LOAD; draft 14 has none: INTERNAL_ERROR (moqt.aio.limits)
        return excessive_load_code(draft)
    if draft is Draft.D14:
        return int({"does-not-exist": FetchErrorCode14.TRACK_DOES_NOT_EXIST, "invalid-range":
                    FetchErrorCode14.INVALID_RANGE, "unauthorized": RequestErrorCode14.UNAUTHORIZED,
                    "not-supported": RequestErrorCode14.NOT_SUPPORTED, "timeout": RequestErrorCode14.TIMEOUT}
                   .get(kind, RequestErrorCode14.INTERNAL_ERROR))
    return int({"does-not-exist": RequestErrorCode18.DOES_NOT_EXIST, "invalid-range": RequestErrorCode18.INVALID_RANGE,
                "unauthorized": RequestErrorCode18.UNAUTHORIZED, "not-supported": RequestErrorCode18.NOT_SUPPORTED,
                "timeout": RequestErrorCode18.TIMEOUT}.get(kind, RequestErrorCode18.INTERNAL_ERROR))


def verdict_code(draft: Draft, decision: Decision) -> int:
    """The refusal code of an :class:`~moqt.relay.interfaces.AccessRules` decision."""
    return request_code(draft, "unauthorized" if decision.verdict is Verdict.UNAUTHORIZED else "does-not-exist")


def upstream_error(draft: Draft, error: BaseException, upstream: Draft | None) -> tuple[int, bytes]:
    """The downstream REQUEST_ERROR for an upstream failure. An upstream refusal keeps its meaning (does not exist,
    invalid range, ...) except UNAUTHORIZED: the publisher refused the *relay*, which the subscriber cannot fix,
    so that is an INTERNAL_ERROR downstream."""
    if isinstance(error, NoUpstream):
        return request_code(draft, "does-not-exist"), str(error).encode()
    if isinstance(error, MoqtRequestError) and not error.cancelled:
        kind = _kind_of(upstream, error.error_code)
        return request_code(draft, kind), b"upstream: " + error.reason[:200]
    return request_code(draft, "internal"), f"upstream failed: {type(error).__name__}: {error}"[:300].encode()


def publish_done_code(code: int, upstream: Draft, downstream: Draft) -> int:
    """PUBLISH_DONE status codes moved between the drafts (EXPIRED / TOO_FAR_BEHIND swapped, MALFORMED_TRACK)."""
    if upstream is downstream:
        return code
    source: type[PublishDoneCode14] | type[PublishDoneCode18] = \
        PublishDoneCode14 if upstream is Draft.D14 else PublishDoneCode18
    target: type[PublishDoneCode14] | type[PublishDoneCode18] = \
        PublishDoneCode18 if upstream is Draft.D14 else PublishDoneCode14
    try:
        name = source(code).name
        return int(target[name])
    except (ValueError, KeyError):
        return code


__all__ = ["publish_done_code", "request_code", "upstream_error", "verdict_code"]
