"""Client connections per origin, spread over up to K connections: the one policy HTTP/3 and MOQT pools share.

:class:`SpreadPool` is the mechanism of :class:`http3.h3_client.H3Pool` and :class:`moqt.aio.endpoints.MoqtPool`
(``connections_per_origin``, issue 16 "every core"): a caller takes the least-loaded connection (its own load --
open request streams, open fetches -- plus the callers waiting for a connect in progress) when that one is idle
or K are open or opening already; otherwise another connection is opened. Sequential use therefore stays on one
connection, and K concurrent callers get K connections, each on its own UDP socket (a server whose worker
processes share one port with ``SO_REUSEPORT`` sees K 4-tuples, which the kernel spreads over them).

Connects run in tasks of their own, awaited through ``asyncio.shield``: a slow handshake never holds up a caller
that can use a connection open already, a caller that gives up waiting (its timeout cancels :meth:`get`) does not
abort the connect others wait for, and a failed connect fails everyone waiting for it at once. The subclass says
what a connection is: how to open one (:meth:`SpreadPool.dial`), its load, whether it takes one more caller, which
connections are live, and the error of a closed pool.
"""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

from quic.rtt import RttSample, RttTable, connect_timeout, slowest

C = TypeVar("C")
Origin = tuple[str, int]


class Connecting(Generic[C]):
    """A connection being opened to one origin; the callers waiting for it are its load meanwhile (and stay
    counted on the connection until each has resumed and used it)."""

    __slots__ = ("task", "waiters")

    def __init__(self) -> None:
        self.task: asyncio.Task[C] | None = None
        self.waiters = 0


class SpreadPool(Generic[C]):
    """Connections per origin (host, port), at most *connections_per_origin* that take more callers (see the module
    documentation). Subclasses implement the hooks below and call :meth:`cancel_connects` when they close."""

    kind = "connection"  # for task names

    def __init__(self, connections_per_origin: int = 1, *, connect_timeout: float = 10.0,
                 rtts: RttTable | None = None) -> None:
        if isinstance(connections_per_origin, bool) or connections_per_origin < 1:
            raise ValueError(f"connections_per_origin must be at least 1, not {connections_per_origin!r}")
        self.connections_per_origin = connections_per_origin
        # With an RTT table (quic.rtt; issue 12, point 5) a dial to a host whose RTT is known waits
        # quic.rtt.connect_timeout (a few RTTs, at least 1 s, at most connect_timeout); else connect_timeout.
        self.connect_timeout = connect_timeout
        self.rtts = rtts
        self.connects = 0  # connections opened (tests, metrics)
        self._conns: dict[Origin, list[C]] = {}
        self._connecting: dict[Origin, list[Connecting[C]]] = {}
        self._joining: dict[C, Connecting[C]] = {}  # callers that waited for its connect
        self._closed = False

    # -- hooks ------------------------------------------------------------------------------------------------

    async def dial(self, key: Origin) -> C:
        """Open a connection to *key* (raising the transport's connect error)."""
        raise NotImplementedError

    def load_of(self, conn: C) -> int:
        """What *conn* carries now (open request streams, open fetches)."""
        raise NotImplementedError

    def takes_more(self, conn: C) -> bool:
        """Whether *conn* may take one more caller (open, not retired, under its own caps)."""
        raise NotImplementedError

    def live(self, key: Origin) -> list[C]:
        """The connections to *key* that may take callers; the subclass drops or retires the others here."""
        raise NotImplementedError

    def closed_error(self, key: Origin) -> Exception:
        raise NotImplementedError

    def adopted(self, key: Origin, conn: C) -> None:
        """A new connection to *key* joins the pool (set it up: origin, keep-alive, ...)."""

    def rtt_of(self, conn: C) -> RttSample | None:
        """*conn*'s RTT estimate (None once it is closed)."""
        return None

    async def close_connection(self, conn: C) -> None:
        """Close a connection opened after the pool was closed."""
        raise NotImplementedError

    opening_cap: int | None = None  # callers one connection being opened may take (None: no cap)

    # -- connect timeouts scaled with the RTT ------------------------------------------------------------------

    def dial_timeout(self, host: str) -> float:
        """The connect timeout of the next dial to *host*."""
        if self.rtts is None:
            return self.connect_timeout
        return connect_timeout(self.rtt_sample(host), ceiling=self.connect_timeout)

    def rtt_sample(self, host: str) -> RttSample | None:
        """The RTT estimate of *host*: the table's, the connections open to it now recorded first; without a table,
        the slowest of those connections'."""
        live = [sample for (h, _port), conns in self._conns.items() if h == host
                for c in conns if (sample := self.rtt_of(c)) is not None]
        if self.rtts is None:
            return slowest(live)
        self.rtts.observe(host, live)
        return self.rtts.get(host)

    # -- the policy -----------------------------------------------------------------------------------------

    async def get_for(self, key: Origin) -> C:
        """A connection to *key* for one more caller, who uses it before awaiting anything else (that is what
        makes the use count as the connection's load)."""
        while True:
            if self._closed:
                raise self.closed_error(key)
            choice = self._choose(key)
            if not isinstance(choice, Connecting):
                return choice
            choice.waiters += 1
            try:
                assert choice.task is not None
                conn: C = await asyncio.shield(choice.task)
            finally:
                choice.waiters -= 1
            if self.takes_more(conn):
                return conn
            # closed, discarded or filled up while this caller waited: choose again

    def load(self, conn: C) -> int:
        joining = self._joining.get(conn)
        if joining is not None and joining.waiters == 0:
            del self._joining[conn]
            joining = None
        return self.load_of(conn) + (joining.waiters if joining is not None else 0)

    def forget_joining(self, conn: C) -> None:
        self._joining.pop(conn, None)

    def _choose(self, key: Origin) -> C | Connecting[C]:
        """The connection (or connect in progress) the next caller to *key* goes to: synchronous, so no other caller
        chooses in between."""
        open_ = [(self.load(c), i, c) for i, c in enumerate(self.live(key)) if self.takes_more(c)]
        cap = self.opening_cap
        opening = [(p.waiters, i, p) for i, p in enumerate(self._connecting.get(key, []))
                   if cap is None or p.waiters < cap]
        best_open = min(open_, key=lambda x: x[:2], default=None)
        best_opening = min(opening, key=lambda x: x[:2], default=None)
        if best_open is not None and best_open[0] == 0:
            return best_open[2]
        if best_opening is not None and best_opening[0] == 0:
            return best_opening[2]
        if len(open_) + len(opening) < self.connections_per_origin:
            return self._open(key)
        if best_open is not None and (best_opening is None or best_open[0] <= best_opening[0]):
            return best_open[2]
        if best_opening is not None:
            return best_opening[2]
        return self._open(key)  # every connection is at its own cap: one more, beyond K

    def _open(self, key: Origin) -> Connecting[C]:
        pending: Connecting[C] = Connecting()
        self._connecting.setdefault(key, []).append(pending)
        pending.task = asyncio.get_running_loop().create_task(self._connect(key, pending),
                                                              name=f"{self.kind}-connect-{key[0]}:{key[1]}")
        pending.task.add_done_callback(_consume)
        return pending

    async def _connect(self, key: Origin, pending: Connecting[C]) -> C:
        try:
            conn = await self.dial(key)
        except asyncio.CancelledError:  # only closing the pool cancels a connect
            raise self.closed_error(key) from None
        finally:
            group = self._connecting.get(key)
            if group is not None and pending in group:
                group.remove(pending)
        if self._closed:
            await self.close_connection(conn)
            raise self.closed_error(key)
        self.connects += 1
        self.adopted(key, conn)
        self._conns.setdefault(key, []).append(conn)
        if pending.waiters:
            self._joining[conn] = pending
        return conn

    async def cancel_connects(self) -> list[C]:
        """Mark the pool closed, cancel the connects in progress (their waiters get :meth:`closed_error`) and hand
        back the pooled connections for the subclass to close."""
        self._closed = True
        connecting = [p.task for group in self._connecting.values() for p in group if p.task is not None]
        for task in connecting:
            task.cancel()
        conns = [c for group in self._conns.values() for c in group]
        self._conns.clear()
        self._joining.clear()
        await asyncio.gather(*connecting, return_exceptions=True)
        return conns


def _consume(task: asyncio.Task[object]) -> None:
    """A connect nobody waits for any more still has its outcome retrieved (no 'never retrieved' warning)."""
    if not task.cancelled():
        task.exception()
