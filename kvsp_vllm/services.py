"""The KVSP client of one vLLM process, on an event loop thread of its own: vLLM's scheduler and forward pass never
wait on the network; they submit coroutines here and look at the futures when they need the answers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from http3.client import KvspClient
from kvsp_client.api import KvspApi
from kvsp_client.retrieval import BlockFetcher
from kvsp_quic.compat import CompatDescriptor
from kvsp_vllm.settings import ConnectorSettings

T = TypeVar("T")


class Services:
    """A mutual-TLS :class:`~http3.client.KvspClient`, the retrieval client over it (lookups and verified block
    loads from the configured Index Service) and the typed API (stores at holders), on thread ``kvsp-vllm``."""

    def __init__(self, settings: ConnectorSettings, descriptor: CompatDescriptor) -> None:
        self.settings = settings
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kvsp-vllm", daemon=True)
        self._thread.start()
        timeout = settings.timeout_ms / 1000

        async def make() -> tuple[KvspClient, BlockFetcher, KvspApi]:
            client = KvspClient(settings.tls, timeout=timeout, prefer=settings.transport)
            fetcher = BlockFetcher(client, list(settings.index), descriptors=[descriptor], timeout=timeout)
            return client, fetcher, KvspApi(client, timeout=timeout)

        self.client, self.fetcher, self.api = self.submit(make()).result(timeout=30)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        with contextlib.suppress(Exception):  # best effort at shutdown
            self.submit(self.client.aclose()).result(timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


__all__ = ["Services"]
