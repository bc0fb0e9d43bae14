"""The fuzz targets: every parser that reads peer (or operator) input, with the typed errors it may raise and the
encoder that must round-trip what it accepts (issue 13, point 4; tests/test_fuzz_parsers.py runs them).

A :class:`Target` names the parser, the exception classes it promises (anything else -- ``IndexError``,
``KeyError``, ``UnicodeDecodeError``, ``RecursionError``, ``MemoryError``, a bare ``ValueError`` -- is a failure),
its valid seeds, and, where an encoder exists, the encoder: ``parse(encode(parse(x))) == parse(x)`` for every
input *x* the parser accepts, so a silent mis-parse fails too. Streaming parsers (MOQT streams, the container
decoder) are also fed the same octets in two pieces: the outcome must not depend on where the cut falls.

Parsers that never raise name their outcome instead (``label``): the problem class a problem+json body maps to, and
for HTTP/3 the error code the connection was closed with or the status answered. HTTP/3 is fuzzed at two depths:
``h3:request`` / ``h3:uni`` feed request and unidirectional streams to aioquic's server-side ``H3Connection`` on our
``KvspQuicConnection`` (frames, varints, SETTINGS, QPACK encoder and decoder streams), ``h3:server`` feeds request
streams to our whole server handler (tests/fuzz_h3.py). Neither does a handshake: the QUIC stream a STREAM frame
would create is created directly.

:func:`check` runs one input; :data:`TARGETS` is the table.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import shutil
import tempfile
import tomllib
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from aioquic.h3.connection import ErrorCode, FrameType, H3Connection, encode_frame
from aioquic.quic import events as qe
from aioquic.quic.packet import QuicFrameType
from pylsqpack import Encoder

from kvsp_app import config
from kvsp_frontend.params import Limits, chat_params, completion_params
from kvsp_frontend.text import ChatTemplateError, load_chat_template
from kvsp_quic import container as c
from kvsp_quic import fields as f
from kvsp_quic import records as r
from kvsp_quic.auth import Policy, PolicyError
from kvsp_quic.compat import CompatDescriptor, DescriptorError
from kvsp_quic.problems import BadRequest, Problem, problem_from_json, to_problem_json
from kvsp_quic.roles import controller_records as cr
from kvsp_quic.roles.instance_reshard import ReshardContext
from kvsp_quic.samples import random_sections
from moqt.control import ControlParser, encode_message
from moqt.data import SubgroupHeader, SubgroupObjectEncoder, decode_datagram
from moqt.dataparser import DataStreamParser
from moqt.errors import MoqtError
from moqt.events import DataStreamOpened, Event, ObjectReceived
from moqt.types import Draft, GroupOrder, ObjectStatus
from moqt.varint import NeedMore
from quic.connection import KvspQuicConnection
from quic.tls import quic_configuration


@dataclass(frozen=True)
class Target:
    name: str
    parser: str  # the function under test, as the table prints it
    parse: Callable[[Any], Any]  # input -> a comparable value (or a typed error)
    errors: tuple[type[BaseException], ...]  # what it may raise
    seeds: tuple[Any, ...]  # valid inputs (bytes; str for TOML)
    kind: str  # the mutator: "binary", "json" or "toml"
    encode: Callable[[Any], Any] | None = None  # value -> input, for round-trip equality
    feed: Callable[[list[Any]], Any] | None = None  # a streaming parser fed in pieces: must equal parse
    same: Callable[[Any], Any] | None = None  # what the round trip compares (default: the value itself)
    label: Callable[[Any], str | None] | None = None  # for parsers that never raise: the outcome, named

    @property
    def encoder(self) -> str:
        return "yes" if self.encode is not None else "-"


class FuzzFailure(AssertionError):
    """An untyped exception, or a round trip that changed the value: the target, the input and why."""

    def __init__(self, target: str, data: Any, why: str) -> None:
        super().__init__(f"{target}: {why}\n  input ({len(data)}): {data[:400]!r}")
        self.target = target
        self.data = data


def check(target: Target, data: Any) -> str | None:
    """Run *target* on *data*: None when it parsed (and round-tripped), or the name of the typed error."""
    try:
        value = target.parse(data)
    except target.errors as exc:
        outcome: str | None = type(exc).__name__
        value = None
    except Exception as exc:  # RecursionError and MemoryError included: anything untyped fails
        raise FuzzFailure(target.name, data, f"untyped {type(exc).__name__}: {exc}") from exc
    else:
        outcome = None
    if target.feed is not None and len(data) > 1:
        cut = 1 + (len(data) * 7919 + data[len(data) // 2]) % (len(data) - 1)
        try:
            pieces = target.feed([data[:cut], data[cut:]])
        except target.errors as exc:  # a typed error either way (which one may depend on what arrived first)
            if outcome is None:
                raise FuzzFailure(target.name, data, f"cut at {cut}: {type(exc).__name__}, whole: parsed") from exc
        except Exception as exc:
            raise FuzzFailure(target.name, data, f"cut at {cut}: untyped {type(exc).__name__}: {exc}") from exc
        else:
            if outcome is not None or pieces != value:
                raise FuzzFailure(target.name, data, f"cut at {cut}: {pieces!r} != whole {outcome or value!r}")
    if outcome is None and target.label is not None:
        outcome = target.label(value)
    if value is not None and target.encode is not None:
        try:
            encoded = target.encode(value)
        except Exception as exc:
            raise FuzzFailure(target.name, data, f"what it accepted does not encode: {type(exc).__name__}: {exc}") \
                from exc
        if encoded is not None:
            try:
                again = target.parse(encoded)
            except Exception as exc:
                raise FuzzFailure(target.name, data, f"its re-encoding fails: {type(exc).__name__}: {exc}") from exc
            if (again != value if target.same is None else target.same(again) != target.same(value)):
                raise FuzzFailure(target.name, data, f"round trip changed {value!r} into {again!r}")
    return outcome


# -- KV Block Container ----------------------------------------------------------------------------------------

SMALL = CompatDescriptor.from_json({
    "model": "fuzz", "model_digest": "sha-256:" + "11" * 32, "tokenizer_digest": "sha-256:" + "22" * 32,
    "layers": 4, "kv_heads": 2, "head_dim": 4, "kv_dtype": "fp16", "positional": "rope", "block_tokens": 2,
    "layout": "kvsp-layout-1"})


def _container_seed(first: int, last: int, tokens: int, seed: int) -> bytes:
    sections = random_sections(SMALL, tokens, first, last, seed)
    return c.encode(sections, first_layer=first, token_count=tokens, descriptor=SMALL).tobytes()


CONTAINERS = (_container_seed(0, 3, 2, 1), _container_seed(1, 2, 2, 2), _container_seed(3, 3, 2, 3),
              _container_seed(0, 0, 2, 4))
Layers = tuple[tuple[int, bytes, bytes, bytes | None], ...]


def _layers(header: c.ContainerHeader, layers: Sequence[c.DecodedLayer]) -> tuple[Any, Layers]:
    return (header, tuple((x.index, bytes(x.k), bytes(x.v), x.digest) for x in layers))


def _container(data: bytes) -> tuple[Any, Layers]:
    return _layers(*c.decode(data, SMALL))


def _container_pieces(parts: list[bytes]) -> tuple[Any, Layers]:
    decoder = c.ContainerDecoder(SMALL)
    layers = [x for part in parts for x in decoder.feed(part)]
    return _layers(decoder.finish(), layers)


def _container_encode(value: tuple[Any, Layers]) -> bytes:
    header, layers = value
    return c.encode([(k, v) for _, k, v, _ in layers], first_layer=header.first_layer,
                    token_count=header.token_count, codec=header.codec, descriptor=SMALL).tobytes()


# -- JSON records ------------------------------------------------------------------------------------------------

COMPAT, SCOPE, KEY = "cd" * 32, "ef" * 16, "ab" * 32
SESSION = "6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11"
LAYER_DIGESTS = [hashlib.sha256(bytes([i])).hexdigest() for i in range(4)]
REPLICA = {
    "block_key": KEY, "compat_id": COMPAT, "scope_id": SCOPE, "holder": "https://h1.example/kvsp/", "codec": 1,
    "size": 4096, "digest": "sha-256:" + hashlib.sha256(b"".join(bytes.fromhex(d) for d in LAYER_DIGESTS)).hexdigest(),
    "layer_digests": LAYER_DIGESTS, "ttl_ms": 600000,
    "residency": [{"tier": "device", "layers": [0, 1]}, {"tier": "host", "layers": [2, 3], "read_mbit_per_s": 400}]}
_NS = r.kvsp_track_namespace(bytes.fromhex(COMPAT), bytes.fromhex(SCOPE), "A" * 43, 1)
REPLICA_MOQT = {**REPLICA, "holder": "moqt://relay.example:4443/", "moqt_namespace": r.encode_moqt_namespace(_NS)}
SAMPLER = {"method": "top-p", "params": {"p": 0.9}, "seed": 7, "step": 3, "deterministic": False}
CHECKPOINT = {"session": SESSION, "epoch": 1, "compat_id": COMPAT, "scope_id": SCOPE, "prompt_blocks": [KEY],
              "prompt_tail": [374, 264], "generated": [1296, 315, 279], "output_offset": 3, "sampler": SAMPLER}
PLAN = {"map": "c3f8e1", "from": 4, "to": 5, "deadline_ms": 200, "retain": [[0, 32768]],
        "fetch": [{"tokens": [32768, 49152], "from": "https://ii2.example/kvsp/"}], "release": []}
SESSION_REQUEST = {"session": SESSION, "scope_id": SCOPE, "compat_id": COMPAT, "prompt": [1, 2, 3, 4],
                   "max_tokens": 16, "sampler": SAMPLER, "block_keys": [KEY]}
BODIES: dict[str, tuple[Callable[[Any], Any], list[Any]]] = {  # name -> (reader of a parsed body, seeds)
    "ReplicaRecord": (r.ReplicaRecord.from_json, [REPLICA, REPLICA_MOQT]),
    "LookupRequest": (r.LookupRequest.from_json, [
        {"scope_id": SCOPE, "compat_id": COMPAT, "block_keys": [KEY, "cd" * 32], "targets": ["https://ii7.example/"]}]),
    "LookupResponse": (r.LookupResponse.from_json, [
        {"matched": 1, "blocks": [{"block_key": KEY, "replicas": [REPLICA, REPLICA_MOQT]}],
         "targets": [{"instance": "https://ii7.example/kvsp/", "fetch_us": 5, "recompute_us": 9}]},
        {"matched": 0, "blocks": []}]),
    "LeaseRequest": (r.LeaseRequest.from_json, [
        {"compat_id": COMPAT, "scope_id": SCOPE, "block_keys": [KEY], "ttl_ms": 2000}]),
    "LeaseRenewal": (r.LeaseRenewal.from_json, [{"ttl_ms": 1000}]),
    "LeaseResponse": (r.LeaseResponse.from_json, [
        {"lease": str(uuid.UUID(int=5)), "ttl_ms": 2000, "block_keys": [KEY]}]),
    "InstanceStatusRecord": (r.InstanceStatusRecord.from_json, [{
        "instance": "https://ii7.example/kvsp/", "epoch": 12, "state": "active", "running": 18, "queued": 3,
        "batch_size": 32, "kv_utilization": 0.71, "prefill_tokens_per_s": 42000, "decode_tokens_per_s": 3100,
        "links": [{"holder": "https://h1.example/kvsp/", "mbit_per_s": 200000, "rtt_us": 12}],
        "requested_state": None, "ttl_ms": 3000, "engine": {"name": "reference", "build": "b1", "compat_id": COMPAT}}]),
    "StateMessage": (r.StateMessage.from_json, [{"state": "draining"}]),
    "SessionCheckpoint": (r.SessionCheckpoint.from_json, [CHECKPOINT]),
    "CheckpointAck": (r.CheckpointAck.from_json, [{"session": SESSION, "epoch": 2, "output_offset": 64}]),
    "ResumeRequest": (r.ResumeRequest.from_json, [{"epoch": 2, "checkpoint": CHECKPOINT}]),
    "ShardMap": (r.ShardMap.from_json, [{"map": "c3f8e1", "version": 4, "shards": [
        {"tokens": [0, 32768], "instance": "https://ii1.example/kvsp/"},
        {"tokens": [32768, 65536], "instance": "https://ii2.example/kvsp/"}]}]),
    "reshard": (r.parse_reshard, [PLAN, {"map": "c3f8e1", "commit": 5}, {"map": "c3f8e1", "abort": 5},
                                  {**PLAN, "context": {"compat_id": COMPAT, "scope_id": SCOPE, "block_keys": [KEY]}}]),
    "ReshardContext": (ReshardContext.from_json, [{"compat_id": COMPAT, "scope_id": SCOPE, "block_keys": [KEY]}]),
    "PrefetchDirective": (r.PrefetchDirective.from_json, [{
        "directive": "a2b7c9e0-1f3d-4c1a-8f5b-6d2e9a7c3b10", "request_ref": "opaque", "scope_id": SCOPE,
        "compat_id": COMPAT, "blocks": [{"block_key": KEY, "sources": ["https://h1.example/kvsp/"]}],
        "layer_order": "ascending", "deadline_ms": 50, "lease_ms": 2000}]),
    "PrefetchStatus": (r.PrefetchStatus.from_json, [{"directive": str(uuid.UUID(int=6)), "state": "partial",
                                                     "loaded": [KEY]}]),
    "SessionRequest": (cr.SessionRequest.from_json, [SESSION_REQUEST]),
    "SessionStart": (cr.SessionStart.from_json, [{
        **SESSION_REQUEST, "epoch": 2, "blocks": [{"block_key": KEY, "sources": ["https://h1.example/kvsp/"]}],
        "owner": "urn:kvsp:user:alice"}]),
    "SessionResume": (cr.SessionResume.from_json, [{"epoch": 2, "checkpoint": CHECKPOINT, "max_tokens": 9,
                                                    "prompt": [1, 2], "owner": "https://fe.example/"}]),
    "SessionInfo": (cr.SessionInfo.from_json, [
        {"session": SESSION, "epoch": 1, "output_offset": 3, "state": "running", "instance": "https://ii1.example/"},
        {"session": SESSION, "epoch": 2, "output_offset": 9, "state": "done", "done": True}]),
    "SuspectReport": (cr.SuspectReport.from_json, [{"epoch": 3, "reason": "broken"}]),
    "SuspectAnswer": (cr.SuspectAnswer.from_json, [{"session": SESSION, "epoch": 1, "output_offset": 3,
                                                    "state": "running", "verdict": "moved",
                                                    "instance": "https://ii1.example/"}]),
    "TokenLine": (cr.TokenLine.from_json, [
        {"index": 7, "epoch": 1, "token": 42, "logprob": -0.5, "top_logprobs": [[42, -0.5], [7, -1.25]]},
        {"index": 8, "epoch": 1, "done": True, "reason": "error", "detail": "x"}]),
    "CompatDescriptor": (CompatDescriptor.from_json, [SMALL.to_json()]),
}


def _record_target(name: str, reader: Callable[[Any], Any], seeds: list[Any]) -> Target:
    def parse(data: bytes) -> Any:
        return reader(f.loads_json(data))

    errors: tuple[type[BaseException], ...] = (f.RecordError, DescriptorError) if name == "CompatDescriptor" \
        else (f.RecordError,)
    function = "records.parse_reshard" if name == "reshard" else f"{name}.from_json"
    return Target(f"json:{name}", f"{function}(fields.loads_json(body))", parse,
                  errors, tuple(orjson.dumps(s) for s in seeds), "json",
                  encode=lambda rec: orjson.dumps(rec.to_json()), same=SAME.get(name))


# TokenLine.to_json writes "top_logprobs": [] for a token line with a logprob and no alternatives, which reads back
# as () rather than None: the same line for every reader (both mean "no alternatives").
SAME: dict[str, Callable[[Any], Any]] = {
    "TokenLine": lambda line: dataclasses.replace(line, top_logprobs=line.top_logprobs or None),
}


# -- problem+json --------------------------------------------------------------------------------------------------


def _problem(data: bytes) -> tuple[Any, ...]:
    """The first two octets are the HTTP status (big-endian), the rest the body a peer answered with."""
    status = int.from_bytes(data[:2], "big")
    p = problem_from_json(status, data[2:])
    return (type(p), p.status, p.type_uri, p.title, p.detail)


def _problem_encode(value: tuple[Any, ...]) -> bytes:
    cls, status, type_uri, _title, detail = value
    status_out, body = to_problem_json(Problem(detail, status=status, type_uri=type_uri)
                                       if cls is Problem else cls(detail, status=status))
    return status_out.to_bytes(2, "big") + body


PROBLEMS = tuple(s.to_bytes(2, "big") + json.dumps(b).encode() for s, b in [
    (404, {"type": "https://iana.org/assignments/kvsp#kvsp-not-found", "title": "Not Found", "status": 404,
           "detail": "no such block"}),
    (409, {"type": "https://iana.org/assignments/kvsp#kvsp-stale-epoch", "status": 409, "detail": "epoch 3 < 4"}),
    (400, {"type": "about:blank", "title": "Bad Request", "status": 400, "detail": "x: must be an integer"}),
    (418, {"type": "https://example.com/teapot", "status": 418}),
    (500, {"detail": "boom"})])


# -- OpenAI-compatible front-end bodies ------------------------------------------------------------------------

LIMITS = Limits(model="tiny", context=512, vocab_size=256, max_tokens=64, max_choices=8)
_TEMPLATE_DIR = Path(tempfile.mkdtemp(prefix="kvsp-fuzz-"))
atexit.register(shutil.rmtree, _TEMPLATE_DIR, ignore_errors=True)
(_TEMPLATE_DIR / "tokenizer_config.json").write_text(json.dumps({
    "bos_token": "<s>", "chat_template": "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                                         "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"}))
RENDER = load_chat_template(_TEMPLATE_DIR)


class ByteTokens:
    """gpu.modelfiles.ByteTokenizer's rule (token id = UTF-8 octet), without importing the engines."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", "surrogatepass"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def _openai_object(data: bytes) -> dict[str, Any]:
    body = f.loads_json(data)  # what kvsp_frontend.app.read_json_object does with the octets read
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def _completion(data: bytes) -> Any:
    return completion_params(_openai_object(data), ByteTokens(), LIMITS)


def _chat(data: bytes) -> Any:
    return chat_params(_openai_object(data), ByteTokens(), LIMITS, RENDER)


COMPLETIONS = [
    {"model": "tiny", "prompt": "hello", "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "seed": 5, "n": 2,
     "stop": ["\n"], "logprobs": 2, "echo": True, "stream": True, "stream_options": {"include_usage": True}},
    {"model": "tiny", "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 4, "frequency_penalty": 0.5, "top_k": 5,
     "logit_bias": {"7": -100}, "stop_token_ids": [9], "min_p": 0.1, "user": "u", "best_of": 2, "n": 2},
    {"model": "tiny", "prompt": ["a", "b"], "suffix": "", "presence_penalty": -1, "repetition_penalty": 1.1}]
CHATS = [
    {"model": "tiny", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
     "max_completion_tokens": 8, "logprobs": True, "top_logprobs": 3, "temperature": 0, "tools": []},
    {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}], "name": "n"}],
     "stream": True, "response_format": {"type": "text"}, "chat_template_kwargs": {}}]


# -- MOQT control and data streams, datagrams --------------------------------------------------------------------


def _moqt_seeds(draft: Draft) -> tuple[tuple[bytes, ...], tuple[bytes, ...], tuple[bytes, ...]]:
    """Valid control streams, data streams and datagrams of *draft*, from the codec tests' examples."""
    from tests.support.moqt_examples import DATAGRAMS, FETCH_OBJECTS, MESSAGES_14, MESSAGES_18, fetch_stream

    messages = MESSAGES_14 if draft is Draft.D14 else MESSAGES_18
    each = [encode_message(m, draft) for m in messages]
    control = (*each, b"".join(each))
    data = [fetch_stream(draft, GroupOrder.ASCENDING, FETCH_OBJECTS)]
    for ext, eog in ((False, False), (True, True)):
        header = SubgroupHeader(7, 3, 9, 200, ext, eog)
        enc = SubgroupObjectEncoder(draft, ext)
        data.append(header.encode(draft) + enc.encode(5, 2, extensions=((2, 9),) if ext else ()) + b"hi"
                    + enc.encode(8, 0, status=ObjectStatus.END_OF_GROUP))
    datagrams = tuple(d.encode(draft) for d in DATAGRAMS)
    return control, tuple(data), datagrams


def _control(draft: Draft) -> tuple[Callable[[bytes], Any], Callable[[list[bytes]], Any], Callable[[Any], bytes]]:
    def feed(parts: list[bytes]) -> list[Any]:
        parser = ControlParser(draft)
        return [m for part in parts for m in parser.feed(part)]

    return (lambda data: feed([data])), feed, lambda msgs: b"".join(encode_message(m, draft) for m in msgs)


def _objects(events: list[Event]) -> tuple[Any, ...]:
    """The stream's header and its complete objects (pieces joined), whatever the chunking."""
    out: list[Any] = []
    buf = bytearray()
    for e in events:
        if isinstance(e, DataStreamOpened):
            out.append(("opened", e.track_alias, e.group, e.priority, e.end_of_group))
        elif isinstance(e, ObjectReceived):
            buf += e.data
            if e.complete:
                out.append((e.group, e.object_id, e.subgroup, e.priority, bytes(buf), e.status, e.extensions))
                buf = bytearray()
        else:
            out.append(type(e).__name__)
    return tuple(out)


def _data(draft: Draft) -> tuple[Callable[[bytes], Any], Callable[[list[bytes]], Any]]:
    def feed(parts: list[bytes]) -> tuple[Any, ...]:
        parser = DataStreamParser(draft, 3)
        events = [e for part in parts for e in parser.feed(part)]
        return _objects(events + parser.feed(b"", fin=True))

    return (lambda data: feed([data])), feed


def _datagram(draft: Draft) -> tuple[Callable[[bytes], Any], Callable[[Any], bytes | None]]:
    return (lambda data: decode_datagram(draft, data)), (lambda d: None if d is None else d.encode(draft))


# -- HTTP/3 as our server reads it -----------------------------------------------------------------------------

_PKI_DIR = Path(tempfile.mkdtemp(prefix="kvsp-fuzz-pki-"))
atexit.register(shutil.rmtree, _PKI_DIR, ignore_errors=True)


def _server_configuration() -> Any:
    from tests.pki import make_pki

    pki = make_pki(_PKI_DIR)
    return quic_configuration(pki.files("server"), is_client=False, alpn=["h3"])


_QUIC_CONFIG: list[Any] = []


def _h3_server() -> H3Connection:
    """A fresh server-side HTTP/3 connection on our QUIC connection class (no handshake: H3Connection reads
    stream events, and what it sends is only queued)."""
    if not _QUIC_CONFIG:
        _QUIC_CONFIG.append(_server_configuration())
    return H3Connection(KvspQuicConnection(configuration=_QUIC_CONFIG[0],
                                           original_destination_connection_id=b"\x01" * 8))


def _h3_events(h3: H3Connection, events: list[Any]) -> tuple[Any, ...]:
    out: list[Any] = []
    for event in events:
        h3._quic._get_or_create_stream(QuicFrameType.STREAM_BASE, event.stream_id)  # as a STREAM frame would
        for e in h3.handle_event(event):
            out.append((type(e).__name__, *(getattr(e, a) for a in ("stream_id", "headers", "data", "stream_ended")
                                             if hasattr(e, a))))
    close = h3._quic._close_event
    return (tuple(out), None if close is None else close.error_code)


def _h3_label(value: tuple[Any, ...]) -> str | None:
    """The HTTP/3 or QPACK error the connection was closed with (RFC 9114, 8.1; RFC 9204, 6), if any."""
    code = value[1]
    if code is None:
        return None
    try:
        return f"close:{ErrorCode(code).name}"
    except ValueError:
        return f"close:0x{code:x}"


def _h3_server_label(value: tuple[Any, ...]) -> str | None:
    from tests.fuzz_h3 import label

    return label(value)


def _h3_request(data: bytes) -> tuple[Any, ...]:
    """Request stream 0 as a client writes it; the first two octets give the length of a prefix that goes to the
    client's QPACK encoder stream (stream 2) first, so headers may refer to the dynamic table."""
    n = min(int.from_bytes(data[:2], "big"), max(len(data) - 2, 0))
    h3 = _h3_server()
    events = []
    if n:
        events.append(qe.StreamDataReceived(data=b"\x02" + data[2:2 + n], end_stream=False, stream_id=2))
    events.append(qe.StreamDataReceived(data=data[2 + n:], end_stream=True, stream_id=0))
    return _h3_events(h3, events)


_H3_SERVER: list[Any] = []


def _h3_server_request(data: bytes) -> tuple[Any, ...]:
    """The input of ``h3:request``, read by our whole HTTP/3 server (tests/fuzz_h3.py)."""
    from tests.fuzz_h3 import H3Server

    if not _H3_SERVER:
        _H3_SERVER.append(H3Server())
    n = min(int.from_bytes(data[:2], "big"), max(len(data) - 2, 0))
    outcome: tuple[Any, ...] = _H3_SERVER[0].request(data[2:2 + n], data[2 + n:])
    return outcome


def _h3_uni(data: bytes) -> tuple[Any, ...]:
    """A unidirectional stream the client opens (control, QPACK encoder or decoder, push or an unknown type),
    followed by a well-formed request that must still be read."""
    h3 = _h3_server()
    return _h3_events(h3, [qe.StreamDataReceived(data=data, end_stream=False, stream_id=2),
                           qe.StreamDataReceived(data=H3_GET, end_stream=True, stream_id=4)])


def _h3_seeds() -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
    headers = [(b":method", b"POST"), (b":scheme", b"https"), (b":authority", b"127.0.0.1:8443"),
               (b":path", b"/kvsp/lookup"), (b"content-type", b"application/kvsp+json"), (b"content-length", b"2")]
    static = Encoder()
    _, block = static.encode(0, headers)
    plain = encode_frame(FrameType.HEADERS, block) + encode_frame(FrameType.DATA, b"{}")
    dynamic = Encoder()
    dynamic.apply_settings(max_table_capacity=4096, blocked_streams=16)
    enc_stream, dyn_block = dynamic.encode(0, [*headers, (b"x-kvsp-trace", b"a" * 40)])
    dyn = encode_frame(FrameType.HEADERS, dyn_block) + encode_frame(FrameType.DATA, b"{}")
    _, trailers = static.encode(0, [(b"x-kvsp-trailer", b"1")])
    requests = (b"\x00\x00" + plain, len(enc_stream).to_bytes(2, "big") + enc_stream + dyn,
                b"\x00\x00" + plain + encode_frame(0x21, b"reserved") + encode_frame(FrameType.HEADERS, trailers))
    settings = encode_frame(FrameType.SETTINGS, b"\x01\x40\x64\x07\x10\x06\x44\x00")  # qpack 100, blocked 16, 1024
    uni = (b"\x00" + settings, b"\x00" + settings + encode_frame(FrameType.GOAWAY, b"\x04"),
           b"\x02" + enc_stream, b"\x03", b"\x21" + b"grease")
    return requests, uni


H3_GET = b""


def _init_h3() -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
    global H3_GET
    requests, uni = _h3_seeds()
    H3_GET = requests[0][2:]
    return requests, uni


# -- Policy and configuration files ----------------------------------------------------------------------------

POLICY = """\
[defaults]
roles = ["client"]
scopes = []

[[principal]]
identity = "https://h1.example/kvsp/"
roles = ["holder"]
scopes = ["*"]
publish_for = ["moqt://relay.example:4443/"]

[[principal]]
identity = "urn:kvsp:user:alice"
roles = ["client"]
scopes = ["efefefefefefefefefefefefefefefef"]
api_keys = ["sha256:2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae"]
max_concurrent = 4
tokens_per_minute = 20000

[[principal]]
identity = "https://pc.example/"
roles = ["index", "controller"]
"""


def _policy(text: str) -> Any:
    policy = Policy.loads(text)
    return tuple(sorted((p.identity, tuple(sorted(p.roles)), repr(p.scopes)) for p in policy.principals.values()))


def _toml_value(value: Any) -> str | None:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, Path):
        return json.dumps(str(value))
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return json.dumps(list(value))
    return None


def _config_seed(cls: type[Any], required: dict[str, str]) -> str:
    """A TOML file of *cls* naming every key of every section with its default (what an operator may write),
    plus the *required* keys ("section.key" -> TOML value)."""
    import typing

    lines: list[str] = []
    for fld in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[fld.name]
        base = next((a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)), hint)
        if not dataclasses.is_dataclass(base):
            continue
        lines.append(f"[{fld.name}]")
        for sub in dataclasses.fields(base):
            key = f"{fld.name}.{sub.name}"
            if key in required:
                lines.append(f"{sub.name} = {required[key]}")
                continue
            default = (sub.default if sub.default is not dataclasses.MISSING
                       else sub.default_factory() if sub.default_factory is not dataclasses.MISSING else None)
            text = _toml_value(default)
            if text is not None and default is not None:
                lines.append(f"{sub.name} = {text}")
        lines.append("")
    return "\n".join(lines)


_TLS = {"tls.ca": '"pki/ca.pem"', "tls.cert": '"pki/server.pem"', "tls.key": '"pki/server.key"'}
_SERVER = {"server.listen": '"127.0.0.1:8443"', **_TLS}
CONFIG_FILES: dict[str, tuple[type[Any], dict[str, str]]] = {
    "IndexFile": (config.IndexFile, _SERVER),
    "HolderFile": (config.HolderFile, {**_SERVER, "holder.index": '"https://is.example/"'}),
    "RelayFile": (config.RelayFile, {**_SERVER, "relay.index": '"https://is.example/"'}),
    "InstanceFile": (config.InstanceFile, {**_SERVER, "instance.controller": '"https://pc.example/"'}),
    "FrontendFile": (config.FrontendFile, {**_SERVER, "frontend.controller": '"https://pc.example/"'}),
}


def _config(cls: type[Any]) -> Callable[[str], Any]:
    root = Path("/nonexistent-kvsp-fuzz")

    def parse(text: str) -> Any:
        # config.load = read_toml (TOMLDecodeError -> ConfigError naming the file) + build
        return config.build(cls, tomllib.loads(text), source="config 'fuzz.toml'", root=root)

    return parse


# -- The table ---------------------------------------------------------------------------------------------------


def _targets() -> list[Target]:
    out = [
        Target("container", "kvsp_quic.container.decode", _container, (c.ContainerError,), CONTAINERS, "binary",
               encode=_container_encode, feed=_container_pieces),
    ]
    out += [_record_target(name, reader, seeds) for name, (reader, seeds) in BODIES.items()]
    out += [
        Target("problem+json", "kvsp_quic.problems.problem_from_json", _problem, (), PROBLEMS, "binary",
               encode=_problem_encode, label=lambda v: f"->{v[0].__name__}"),
        Target("openai:completions", "kvsp_frontend.params.completion_params", _completion,
               (BadRequest, Problem, ChatTemplateError), tuple(orjson.dumps(b) for b in COMPLETIONS), "json"),
        Target("openai:chat", "kvsp_frontend.params.chat_params", _chat,
               (BadRequest, Problem, ChatTemplateError), tuple(orjson.dumps(b) for b in CHATS), "json"),
    ]
    for draft in Draft:
        control, data, datagrams = _moqt_seeds(draft)
        parse, feed, encode = _control(draft)
        out.append(Target(f"moqt{draft.value}:control", "moqt.control.ControlParser.feed", parse, (MoqtError,),
                          control, "binary", encode=encode, feed=feed))
        parse_data, feed_data = _data(draft)
        out.append(Target(f"moqt{draft.value}:data", "moqt.dataparser.DataStreamParser.feed", parse_data,
                          (MoqtError,), data, "binary", feed=feed_data))
        parse_dg, encode_dg = _datagram(draft)
        out.append(Target(f"moqt{draft.value}:datagram", "moqt.data.decode_datagram", parse_dg, (MoqtError, NeedMore),
                          datagrams, "binary", encode=encode_dg))
    requests, uni = _init_h3()
    out += [
        Target("h3:request", "aioquic H3Connection.handle_event (server, KvspQuicConnection)", _h3_request, (),
               requests, "binary", label=_h3_label),
        Target("h3:server", "http3.h3_server.H3AsgiHandler.quic_event_received (+ its tasks)", _h3_server_request,
               (), requests, "binary", label=_h3_server_label),
        Target("h3:uni", "aioquic H3Connection.handle_event (server, KvspQuicConnection)", _h3_uni, (), uni,
               "binary", label=_h3_label),
        Target("toml:policy", "kvsp_quic.auth.Policy.loads", _policy, (PolicyError,), (POLICY,), "toml"),
    ]
    out += [Target(f"toml:{name}", f"kvsp_app.config.build({name})", _config(cls),
                   (config.ConfigError, tomllib.TOMLDecodeError), (_config_seed(cls, required),), "toml")
            for name, (cls, required) in CONFIG_FILES.items()]
    return out


TARGETS: list[Target] = _targets()
BY_NAME = {t.name: t for t in TARGETS}

__all__ = ["BY_NAME", "LIMITS", "REPLICA", "SAMPLER", "SESSION_REQUEST", "TARGETS", "ByteTokens", "FuzzFailure",
           "Target", "check"]
