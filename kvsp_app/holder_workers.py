"""``kvsp-quic holder --workers N``: one port, one block store, N processes (issue 16, "every core").

The process started by the command is the **primary**: it binds the TCP and UDP sockets with ``SO_REUSEPORT``,
owns the :class:`~kvsp_quic.roles.holder.Holder` (placement, eviction, leases, the one publisher of Replica
Records) with a shared host tier (:mod:`kvsp_quic.storage.shared_host`), serves like any holder, and starts N-1
**workers** (``multiprocessing``, spawned). Each worker binds the same port with ``SO_REUSEPORT`` -- the kernel
hands each new TCP connection, and each QUIC connection's datagrams (by address hash: QUIC without connection
migration keeps a client on one worker), to one of them -- and serves block GET/PUT and MOQT from the shared store
through a :class:`~kvsp_quic.roles.holder_worker.HolderWorker`.

Workers ask the primary over a Unix socket (in the shared host tier's 0700 directory) with one framed request per
call: 4 octets of length, then JSON. :class:`ControlServer` answers in the primary's event loop;
:class:`ControlLink` is a worker's blocking client (each call is short: the primary does bookkeeping, never I/O on
block octets). A worker that dies is started again (at most :data:`MAX_RESTARTS` a minute); a worker whose primary
is gone stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import orjson

from kvsp_app import event_loop
from kvsp_app.workers import worker_process
from kvsp_quic.auth import Policy
from kvsp_quic.problems import Forbidden, Problem, Unavailable, problem_from_json
from kvsp_quic.records import LeaseRenewal, LeaseRequest, LeaseResponse, ReplicaRecord
from kvsp_quic.roles.holder import Holder, HolderSettings
from kvsp_quic.storage.tiers import BlockId, ChainPosition

log = logging.getLogger("kvsp.workers")

_LENGTH = struct.Struct(">I")
MAX_MESSAGE = 1 << 20
MAX_RESTARTS = 5  # per worker per minute; beyond that the worker stays down (logged)
CONTROL_SOCKET = "control.sock"


def _frame(obj: Any) -> bytes:
    body = orjson.dumps(obj)
    return _LENGTH.pack(len(body)) + body


def _block(hexes: list[str]) -> BlockId:
    compat, scope, key = (bytes.fromhex(h) for h in hexes)
    if (len(compat), len(scope), len(key)) != (32, 16, 32):
        raise ValueError("a block id is 32 + 16 + 32 octets")
    return BlockId(compat, scope, key)


def _hexes(block: BlockId) -> list[str]:
    return [block.compat_id.hex(), block.scope_id.hex(), block.block_key.hex()]


# -- the primary's side -----------------------------------------------------------------------------------------


class ControlServer:
    """The primary's answers to its workers: commits of staged uploads, leases, faults, reads."""

    def __init__(self, holder: Holder, policy: Policy, path: Path) -> None:
        self.holder = holder
        self.policy = policy
        self.path = path
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=os.fspath(self.path))
        os.chmod(self.path, 0o600)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
                if length > MAX_MESSAGE:
                    break
                reply = self.answer(orjson.loads(await reader.readexactly(length)))
                writer.write(_frame(reply))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, orjson.JSONDecodeError):
            pass
        finally:
            writer.close()

    def answer(self, msg: dict[str, Any]) -> dict[str, Any]:
        try:
            return {"ok": self._dispatch(msg)}
        except Problem as problem:
            return {"problem": problem.to_json(), "status": problem.status}
        except Exception as exc:
            log.exception("worker request %s failed", msg.get("op"))
            return {"error": f"{type(exc).__name__}: {exc}"}

    def _dispatch(self, msg: dict[str, Any]) -> Any:
        op = msg.get("op")
        holder = self.holder
        if op == "commit":
            holder.note_reads([_block(b) for b in msg.get("reads", ())])
            owner, position = msg.get("owner"), msg.get("position")
            return holder.commit_staged(_block(msg["block"]), str(msg["staged"]),
                                        owner=str(owner) if owner is not None else None,
                                        position=ChainPosition.from_text(str(position)) if position else None,
                                        ).to_json()
        if op == "lease":
            return holder.create_lease(self._principal(msg), LeaseRequest.from_json(msg["request"])).to_json()
        if op == "renew":
            return holder.renew_lease(self._principal(msg), uuid.UUID(msg["lease"]),
                                      LeaseRenewal.from_json(msg["renewal"])).to_json()
        if op == "release":
            holder.release_lease(self._principal(msg), uuid.UUID(msg["lease"]))
            return None
        if op == "fault":
            holder.fault(_block(msg["block"]), str(msg["reason"]))
            return None
        if op == "reads":
            holder.note_reads([_block(b) for b in msg["blocks"]])
            return None
        raise ValueError(f"unknown operation {op!r}")

    def _principal(self, msg: dict[str, Any]) -> Any:
        principal = self.policy.principal(str(msg["identity"]))
        if principal is None:
            raise Forbidden("the identity is not in the holder's policy")
        return principal


# -- a worker's side --------------------------------------------------------------------------------------------


class ControlLink:
    """A worker's blocking client of :class:`ControlServer` (implements
    :class:`~kvsp_quic.roles.holder_worker.PrimaryLink`)."""

    def __init__(self, path: Path, timeout: float = 30.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(os.fspath(path))

    def call(self, msg: dict[str, Any]) -> Any:
        try:
            self.sock.sendall(_frame(msg))
            (length,) = _LENGTH.unpack(self._exactly(_LENGTH.size))
            reply = orjson.loads(self._exactly(length))
        except (OSError, orjson.JSONDecodeError) as exc:
            raise Unavailable(f"the holder's primary process did not answer: {exc}") from None
        if "ok" in reply:
            return reply["ok"]
        if "problem" in reply:
            raise problem_from_json(int(reply["status"]), reply["problem"])
        raise RuntimeError(f"the holder's primary process failed: {reply.get('error')}")

    def _exactly(self, n: int) -> bytes:
        chunks, got = [], 0
        while got < n:
            chunk = self.sock.recv(n - got)
            if not chunk:
                raise ConnectionError("the primary closed the control connection")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def commit(self, block: BlockId, staged: str, reads: list[BlockId], owner: str | None,
               position: ChainPosition | None = None) -> ReplicaRecord:
        return ReplicaRecord.from_json(self.call({"op": "commit", "block": _hexes(block), "staged": staged,
                                                  "reads": [_hexes(b) for b in reads], "owner": owner,
                                                  "position": position.to_text() if position else None}))

    def create_lease(self, identity: str, request: LeaseRequest) -> LeaseResponse:
        return LeaseResponse.from_json(self.call({"op": "lease", "identity": identity, "request": request.to_json()}))

    def renew_lease(self, identity: str, lease_id: uuid.UUID, renewal: LeaseRenewal) -> LeaseResponse:
        return LeaseResponse.from_json(self.call({"op": "renew", "identity": identity, "lease": str(lease_id),
                                                  "renewal": renewal.to_json()}))

    def release_lease(self, identity: str, lease_id: uuid.UUID) -> None:
        self.call({"op": "release", "identity": identity, "lease": str(lease_id)})

    def fault(self, block: BlockId, reason: str) -> None:
        self.call({"op": "fault", "block": _hexes(block), "reason": reason})

    def reads(self, blocks: list[BlockId]) -> None:
        self.call({"op": "reads", "blocks": [_hexes(b) for b in blocks]})

    def close(self) -> None:
        self.sock.close()


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process needs (pickled to it)."""

    index: int
    settings: HolderSettings
    files: Any  # quic.tls.TlsFiles
    policy_file: Path | None  # None: the --dev policy (every certificate of the dev CA)
    transport: Any  # quic.tls.TransportSettings
    host: str
    port: int
    host_directory: Path
    log_level: int
    moqt_alpns: tuple[str, ...]
    event_loop: str = "auto"  # kvsp_app.event_loop

    @property
    def control(self) -> Path:
        return self.host_directory / CONTROL_SOCKET


def worker_main(spec: WorkerSpec, ready: Any) -> None:
    """A worker process's entry point (*ready*: a ``multiprocessing`` event, set once it serves)."""
    worker_process(spec.index, spec.log_level)
    with contextlib.suppress(KeyboardInterrupt):
        event_loop.run(_serve_worker(spec, ready), spec.event_loop)


async def _serve_worker(spec: WorkerSpec, ready: Any) -> None:
    from http3.server import RoleServer, bind_pair
    from kvsp_app.reload import reload_on_sighup
    from kvsp_http.holder_app import holder_app
    from kvsp_moqt.holder_tracks import holder_moqt_handlers
    from kvsp_quic.metrics import Registry
    from kvsp_quic.roles.holder_worker import HolderWorker

    parent = os.getppid()  # a worker whose primary is gone stops
    link = ControlLink(spec.control)
    worker = HolderWorker(spec.settings, spec.host_directory, link)
    policy = Policy.load(spec.policy_file) if spec.policy_file is not None else Policy.dev_ca()
    sockets = bind_pair(spec.host, spec.port, spec.transport.socket_buffer, reuse_port=True)
    server = RoleServer(holder_app(worker, policy, metrics=Registry()), spec.files, settings=spec.transport,
                        quic_handlers=holder_moqt_handlers(cast(Any, worker), policy, alpns=spec.moqt_alpns))
    await server.start(sockets=sockets)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    reload_on_sighup(policy, spec.policy_file, spec.files)  # the primary passes SIGHUP on (kvsp_app.reload)
    ready.set()
    try:
        while not stop.is_set() and os.getppid() == parent:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
            reads = worker.take_reads()
            if reads:
                with contextlib.suppress(Problem, RuntimeError):
                    link.reads(reads)
    finally:
        await server.close()
        worker.close()
        link.close()


def make_host_directory(port: int) -> Path:
    """A fresh 0700 directory for the shared host tier and the control socket. Directories that holders killed
    without a chance to clean up left behind (their process is gone) are removed first: they hold memory."""
    from kvsp_quic.storage.shared_host import default_directory

    path = default_directory(f"kvsp-holder-{port}-{os.getpid()}")
    for stale in path.parent.glob("kvsp-holder-*-*"):
        pid = stale.name.rsplit("-", 1)[1]
        if pid.isdigit() and not _alive(int(pid)):
            log.info("removing %s, left by holder process %s", stale, pid)
            shutil.rmtree(stale, ignore_errors=True)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(mode=0o700, parents=True)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
