"""The JSON bodies of the Placement Controller's extension resources (docs/inference.md), as records.

KVSP leaves inference requests out of scope; kvsp-quic fixes these shapes so that its front end, Placement
Controller and instances agree. Unknown members are ignored, as in every KVSP record.

* :class:`SessionRequest` -- ``POST {pc}sessions`` from the front end;
* :class:`SessionStart` -- ``POST {ii}sessions/{id}/start`` from the PC: the request plus ``epoch`` and the
  lookup's matched blocks, and *(extension)* ``owner``: the identity that created the session at the PC;
* :class:`SessionResume` -- ``POST {ii}sessions/{id}/resume``: the spec's ``{"epoch", "checkpoint"}`` plus two
  extension members, ``max_tokens`` and ``prompt``, so the new instance knows when to stop and can recompute prompt
  blocks no replica serves (an instance that knows only the spec's members reads it as a
  :class:`~kvsp_quic.records.ResumeRequest`), and ``owner`` as in the start;
* :class:`SessionInfo` -- the PC's answer to ``POST sessions`` and ``GET sessions/{id}``;
* :class:`SuspectReport` / :class:`SuspectAnswer` -- ``POST {pc}sessions/{id}/suspect`` (extension, docs/wire.md
  "Suspect reports"): the front end says the session's token stream broke or stalled; the PC verifies and answers;
* :class:`TokenLine` -- one line of ``GET {ii}sessions/{id}/tokens`` (``application/x-ndjson``): an output token
  ``{"index", "epoch", "token"}``, or the final line ``{"index", "epoch", "done": true, "reason"[, "detail"]}``.
"""

from __future__ import annotations

import enum
import json
import math
import uuid
from dataclasses import dataclass
from typing import Any

from kvsp_quic import fields as f
from kvsp_quic.fields import BlockKey, CompatId, RecordError, ScopeId
from kvsp_quic.records import PrefetchBlock, Record, Sampler, SessionCheckpoint, wire


def _tokens(value: Any, path: str) -> tuple[int, ...]:
    return f.array(value, path, f.uint32, nonempty=True)


def _keys(value: Any, path: str) -> tuple[BlockKey, ...]:
    return f.array(value, path, f.block_key)


def _blocks(value: Any, path: str) -> tuple[PrefetchBlock, ...]:
    return f.array(value, path, PrefetchBlock.read)


def _alternatives(value: Any, path: str) -> tuple[tuple[int, float], ...]:
    def pair(item: Any, where: str) -> tuple[int, float]:
        if not isinstance(item, list) or len(item) != 2:
            raise f.fail(where, "a [token, logprob] pair")
        return f.uint32(item[0], f"{where}[0]"), float(f.number(item[1], f"{where}[1]", minimum=-math.inf, maximum=0))

    return f.array(value, path, pair)


class SessionState(enum.Enum):
    PLACING = "placing"  # being assigned to its first instance
    RUNNING = "running"  # an instance serves it in the current epoch
    MIGRATING = "migrating"  # its instance failed; the PC looks for another (the epoch has been incremented)
    DONE = "done"  # the instance reported the last token


def _state(value: Any, path: str) -> SessionState:
    text = f.string(value, path)
    try:
        return SessionState(text)
    except ValueError:
        raise f.fail(path, f"{text!r} is not a session state") from None


@dataclass(frozen=True)
class SessionRequest(Record):
    """``POST {pc}sessions``: the front end asks for a session. ``block_keys`` are the prompt's Block Keys (the
    front end holds the scope key; the PC never does)."""

    session: uuid.UUID = wire(f.uuid_string)
    scope_id: ScopeId = wire(f.scope_id)
    compat_id: CompatId = wire(f.compat_id)
    prompt: tuple[int, ...] = wire(_tokens)
    max_tokens: int = wire(f.positive)
    sampler: Sampler = wire(Sampler.read)
    block_keys: tuple[BlockKey, ...] = wire(_keys, default=())

    def check(self) -> None:
        if len(self.block_keys) > len(self.prompt):
            raise RecordError(f"block_keys: {len(self.block_keys)} keys for a prompt of {len(self.prompt)} tokens")


@dataclass(frozen=True)
class SessionStart(Record):
    """``POST {ii}sessions/{id}/start``: :class:`SessionRequest` plus the session ``epoch`` and the lookup's
    matched blocks (``[{"block_key", "sources"}]``, in prefix order; ``sources`` are every holder the Index
    Service listed, the instance itself included when it holds the block).

    *(extension)* ``owner``: the authenticated identity that created the session at the PC (its front end or
    client); the instance serves the session's resources (its token stream, ``GET sessions/{id}``) only to that
    identity or to the PC (docs/wire.md, "Session owner"). Absent from a PC that does not send it: then any
    principal of the session's scope may read them, as before."""

    session: uuid.UUID = wire(f.uuid_string)
    epoch: int = wire(f.positive)
    scope_id: ScopeId = wire(f.scope_id)
    compat_id: CompatId = wire(f.compat_id)
    prompt: tuple[int, ...] = wire(_tokens)
    max_tokens: int = wire(f.positive)
    sampler: Sampler = wire(Sampler.read)
    block_keys: tuple[BlockKey, ...] = wire(_keys, default=())
    blocks: tuple[PrefetchBlock, ...] = wire(_blocks, default=())
    owner: str | None = wire(f.string, default=None)

    @classmethod
    def of(cls, request: SessionRequest, epoch: int, blocks: tuple[PrefetchBlock, ...],
           owner: str | None = None) -> SessionStart:
        return cls(request.session, epoch, request.scope_id, request.compat_id, request.prompt, request.max_tokens,
                   request.sampler, request.block_keys, blocks, owner)


@dataclass(frozen=True)
class SessionResume(Record):
    """``POST {ii}sessions/{id}/resume``: the spec's members plus ``max_tokens``, ``prompt`` and ``owner``
    (extension; ``owner`` as in :class:`SessionStart`)."""

    epoch: int = wire(f.positive)
    checkpoint: SessionCheckpoint = wire(SessionCheckpoint.read)
    max_tokens: int | None = wire(f.positive, default=None)
    prompt: tuple[int, ...] | None = wire(_tokens, default=None)
    owner: str | None = wire(f.string, default=None)

    def check(self) -> None:
        if self.epoch <= self.checkpoint.epoch:
            raise RecordError(f"epoch: the resume epoch {self.epoch} must exceed the checkpoint's "
                              f"{self.checkpoint.epoch}")


@dataclass(frozen=True)
class SessionInfo(Record):
    """The PC's view of a session for its front end: ``{"session", "epoch", "instance", "output_offset", "state"}``
    (and ``"done": true`` once done). ``epoch`` is the epoch ``instance`` serves; while the session is being placed
    or migrated ``instance`` is absent and ``epoch`` is the one it was last served in, so a front end that waits
    for the epoch to grow gets the new instance with it."""

    session: uuid.UUID = wire(f.uuid_string)
    epoch: int = wire(f.positive)
    output_offset: int = wire(f.uint)
    state: SessionState = wire(_state)
    instance: str | None = wire(f.https_uri, default=None)

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        if self.state is SessionState.DONE:
            out["done"] = True
        return out


class Verdict(enum.Enum):
    """What the PC made of a suspect report (the ``"verdict"`` member of :class:`SuspectAnswer`)."""

    HEALTHY = "healthy"  # the instance answered for the session: nothing moved; read it again
    MOVED = "moved"  # the session is at a newer epoch than the report's: ``instance`` serves it
    MIGRATING = "migrating"  # the run failed; no instance took the session yet (ask again, or GET the session)


def _verdict(value: Any, path: str) -> Verdict:
    text = f.string(value, path)
    try:
        return Verdict(text)
    except ValueError:
        raise f.fail(path, f"{text!r} is not a verdict") from None


@dataclass(frozen=True)
class SuspectReport(Record):
    """*(extension)* ``POST {pc}sessions/{id}/suspect``: the session's owner saw its token stream from the instance
    of ``epoch`` break or stall (``reason``: ``"broken"`` or ``"stall"``, informative)."""

    epoch: int = wire(f.positive)
    reason: str = wire(f.string, default="stall")


@dataclass(frozen=True)
class SuspectAnswer(Record):
    """*(extension)* The answer to a :class:`SuspectReport`: the session's :class:`SessionInfo` members after the
    PC's verification (and migration, if it came to that) plus ``verdict``."""

    session: uuid.UUID = wire(f.uuid_string)
    epoch: int = wire(f.positive)
    output_offset: int = wire(f.uint)
    state: SessionState = wire(_state)
    verdict: Verdict = wire(_verdict)
    instance: str | None = wire(f.https_uri, default=None)

    @classmethod
    def of(cls, info: SessionInfo, verdict: Verdict) -> SuspectAnswer:
        return cls(info.session, info.epoch, info.output_offset, info.state, verdict, info.instance)

    @property
    def info(self) -> SessionInfo:
        return SessionInfo(self.session, self.epoch, self.output_offset, self.state, self.instance)


@dataclass(frozen=True)
class TokenLine(Record):
    """One NDJSON line of an instance's token stream.

    An output token: ``index`` (its position in the session's output), ``epoch`` (the epoch that produced it) and
    ``token``. The final line instead has ``done`` true, ``index`` = the number of output tokens, and a
    ``reason`` ("length", "stop", ... or "error", then with a ``detail``). A stream that ends without a final line
    was superseded: the session moved to another instance.

    *(extension)* When the session's sampler asks for ``logprobs``, a token line also has ``logprob`` (the token's
    log probability) and ``top_logprobs`` (``[[token, logprob], ...]``, the most likely tokens, best first);
    tokens a resumed run took from its checkpoint have none (docs/wire.md, "Log probabilities").

        TokenLine(7, 1, 42).encode()                            # b'{"index":7,"epoch":1,"token":42}\n'
        TokenLine(8, 1, done=True, reason="length").encode()
        TokenLine.decode(line)                                  # RecordError (a 400 Problem) on a bad line
    """

    index: int = wire(f.uint)
    epoch: int = wire(f.uint)
    token: int | None = wire(f.uint32, default=None)
    done: bool = wire(f.boolean, default=False)
    reason: str | None = wire(f.string, default=None)
    detail: str | None = wire(lambda v, p: f.string(v, p, nonempty=False), default=None)
    logprob: float | None = wire(lambda v, p: float(f.number(v, p, minimum=-math.inf, maximum=0.0)), default=None)
    top_logprobs: tuple[tuple[int, float], ...] | None = wire(_alternatives, default=None)

    def check(self) -> None:
        if self.done:
            if self.token is not None:
                raise RecordError("token: the final line (done) carries no token")
            if self.reason is None:
                raise RecordError("reason: the final line (done) needs a reason")
        else:
            if self.token is None:
                raise RecordError("token: required unless the line is the final one (done)")
            if self.reason is not None or self.detail is not None:
                raise RecordError("reason: only the final line (done) has a reason or detail")
        if self.top_logprobs is not None and self.logprob is None:
            raise RecordError("top_logprobs: only with a logprob")
        if self.done and self.logprob is not None:
            raise RecordError("logprob: the final line (done) carries none")

    @property
    def failed(self) -> bool:
        """The final line of a session the instance could not complete."""
        return self.done and self.reason == "error"

    def to_json(self) -> dict[str, Any]:
        if not self.done:
            line: dict[str, Any] = {"index": self.index, "epoch": self.epoch, "token": self.token}
            if self.logprob is not None:
                line["logprob"] = self.logprob
                line["top_logprobs"] = [list(pair) for pair in self.top_logprobs or ()]
            return line
        out: dict[str, Any] = {"index": self.index, "epoch": self.epoch, "done": True, "reason": self.reason}
        if self.detail is not None:
            out["detail"] = self.detail
        return out

    def encode(self) -> bytes:
        """The line as sent: compact JSON and a newline."""
        return json.dumps(self.to_json(), separators=(",", ":")).encode() + b"\n"

    @classmethod
    def decode(cls, line: bytes | str) -> TokenLine:
        """One line (with or without its newline); :class:`~kvsp_quic.fields.RecordError` names what is wrong."""
        try:
            return cls.from_json(f.loads_object(line, "token line"), "token line")
        except RecordError as exc:
            text = line if isinstance(line, str) else line.decode("utf-8", "replace")
            raise RecordError(f"{exc.detail} (line {text.strip()[:200]!r})") from None


__all__ = ["SessionInfo", "SessionRequest", "SessionResume", "SessionStart", "SessionState", "SuspectAnswer",
           "SuspectReport", "TokenLine", "Verdict"]
