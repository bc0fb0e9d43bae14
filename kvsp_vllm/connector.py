"""``KvspConnector``: vLLM's KV connector API (``KVConnectorBase_V1``) over KVSP.

Scheduler side (vLLM's EngineCore process): for a new request, the Block Keys of its complete prompt blocks (the
HMAC chain of the configured scope key: spec, "Scopes and Block Keys") and one longest-prefix lookup at the Index
Service for the blocks beyond vLLM's own local hit, on the connector's event loop thread: until the answer is in,
``get_num_new_matched_tokens`` answers None and vLLM asks again at its next step, never waiting on the network. At
least one prompt token is always left to compute. Each step's plan (:class:`KvspMetadata`) names the blocks the
workers load (with the replicas the lookup listed) and the complete prompt blocks they store.

Worker side: ``start_load_kv`` starts the verified retrieval of every planned block (kvsp_client.retrieval:
layer digests, Repr-Digest, failover between replicas, a lease on each replica while it is read); each layer is
copied into vLLM's paged cache as soon as it is verified; ``wait_for_layer_load`` returns once that layer of every
block of the step is in (or failed), so attention on layer 0 runs while later layers are still in flight.
``save_kv_layer`` copies each planned block's layer out of the cache (kvsp_vllm.layouts) and, after the last layer,
the container is stored at a holder (``PUT`` with ``If-None-Match: *``; the holder publishes it) in the background.
Blocks that failed to load are reported by ``get_block_ids_with_load_errors`` (vLLM recomputes them).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvsp_client.api import RetryElsewhere
from kvsp_client.retrieval import IndexUnavailable
from kvsp_quic import container
from kvsp_quic.keys import BlockKeyer
from kvsp_quic.problems import Problem
from kvsp_quic.records import LookupMatch, LookupResponse
from kvsp_vllm.descriptor import descriptor_of, kv_dtype_of
from kvsp_vllm.layouts import PagedLayout, cpu_layout_name
from kvsp_vllm.services import Services
from kvsp_vllm.settings import settings_from_extra

log = logging.getLogger("kvsp.vllm")


@dataclass(frozen=True)
class LoadBlock:
    block_id: int  # vLLM's block
    match: LookupMatch  # the block's key and replicas, as the Index Service listed them


@dataclass(frozen=True)
class SaveBlock:
    block_id: int
    key: bytes


@dataclass
class KvspMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's plan, from the scheduler to the workers."""

    loads: list[LoadBlock] = field(default_factory=list)
    saves: list[SaveBlock] = field(default_factory=list)


@dataclass
class _Request:
    keys: list[bytes]
    usable: int  # blocks that may be loaded: all complete ones but the one holding the last prompt token
    start: int = -1  # the first block looked up (vLLM's local hit)
    lookup: Any = None  # concurrent.futures.Future[LookupResponse | IndexUnavailable]
    matched: tuple[LookupMatch, ...] = ()
    block_ids: list[int] = field(default_factory=list)
    known: int = 0  # blocks the index or vLLM already has: never stored again
    stored: int = 0  # blocks planned for storing so far


class KvspConnector(KVConnectorBase_V1):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.settings = settings_from_extra(extra)
        model, cache = vllm_config.model_config, vllm_config.cache_config
        self.block_size = int(cache.block_size)
        self.descriptor = descriptor_of(model.model, self.block_size, kv_dtype_of(model.dtype, cache.cache_dtype))
        self.keyer = BlockKeyer(self.settings.scope_key, self.descriptor.compat_id, self.block_size)
        self.services = Services(self.settings, self.descriptor)
        self.is_scheduler = role == KVConnectorRole.SCHEDULER
        log.warning("KVSP connector (%s): compat_id %s, %s", "scheduler" if self.is_scheduler else "worker",
                    self.descriptor.compat_id.hex(), self.settings)
        # scheduler side
        self._requests: dict[str, _Request] = {}
        self._loads: list[LoadBlock] = []
        # worker side
        self._layers: list[Any] = []
        self._layer_of: dict[str, int] = {}
        self.layout: PagedLayout | None = None
        self._cond = threading.Condition()
        self._loaded: list[int] = []  # per layer: blocks of the step done (verified and copied, or failed)
        self._load_count = 0
        self._load_errors: set[int] = set()
        self._saving: dict[int, list[tuple[bytes, bytes]]] = {}
        self._warned: set[str] = set()

    # -- scheduler side ----------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._requests.get(request.request_id)
        if state is None:
            prompt = list(request.prompt_token_ids or [])
            keys = [bytes(k) for k in self.keyer.keys(prompt)]
            state = _Request(keys, (len(prompt) - 1) // self.block_size)
            self._requests[request.request_id] = state
        local = num_computed_tokens // self.block_size
        if local >= state.usable:
            state.known = max(state.known, local)
            return 0, False
        if state.lookup is None or state.start != local:
            state.start = local
            state.lookup = self.services.submit(self.services.fetcher.find(
                self.descriptor.compat_id, self.keyer.scope_id, state.keys[local:]))
            return None, False
        if not state.lookup.done():
            return None, False
        try:
            found = state.lookup.result()
        except (Problem, RetryElsewhere, OSError) as exc:
            self._warn_once("lookup", f"lookup at the Index Service failed, computing instead: {exc}")
            found = LookupResponse(0, ())
        if isinstance(found, IndexUnavailable):
            self._warn_once("lookup", f"the Index Service did not answer, computing instead: {found.detail}")
            found = LookupResponse(0, ())
        state.known = max(state.known, local + found.matched)
        state.matched = found.blocks[:state.usable - local]
        return len(state.matched) * self.block_size, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return
        ids = blocks.get_block_ids()[0]
        count = num_external_tokens // self.block_size
        for i, match in enumerate(state.matched[:count]):
            self._loads.append(LoadBlock(ids[state.start + i], match))

    def build_connector_meta(self, scheduler_output: Any) -> KvspMetadata:
        meta = KvspMetadata(loads=self._loads)
        self._loads = []
        steps: list[tuple[str, list[int] | None, int, bool]] = []
        for new in scheduler_output.scheduled_new_reqs:
            steps.append((new.req_id, list(new.block_ids[0]), new.num_computed_tokens, True))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            steps.append((req_id, list(new_ids[0]) if new_ids is not None else None, cached.num_computed_tokens[i],
                          req_id in cached.resumed_req_ids))
        for req_id, ids, computed, replace in steps:
            state = self._requests.get(req_id)
            if state is None:
                continue
            if replace:
                state.block_ids = ids or []
            elif ids:
                state.block_ids.extend(ids)
            if not self.settings.publish:
                continue
            done = min(computed + scheduler_output.num_scheduled_tokens.get(req_id, 0), len(state.keys) *
                       self.block_size) // self.block_size
            first = max(state.known, state.stored)
            for b in range(first, min(done, len(state.block_ids))):
                meta.saves.append(SaveBlock(state.block_ids[b], state.keys[b]))
            state.stored = max(state.stored, done)
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        return False, None

    # -- worker side -------------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        names = sorted(kv_caches, key=extract_layer_index)
        self._layers = [kv_caches[n] for n in names]
        self._layer_of = {n: i for i, n in enumerate(names)}
        if len(names) != self.descriptor.layers:
            raise ValueError(f"vLLM has {len(names)} KV caches; the descriptor {self.descriptor.layers} layers")
        first = self._layers[0]
        if first.device.type != "cpu":
            raise ValueError(f"KV caches on {first.device}: this connector supports vLLM's CPU backend for now")
        isa = _get_attn_isa(first.dtype, self.block_size, self.descriptor.head_dim)
        self.layout = PagedLayout(cpu_layout_name(isa), self.block_size, self.descriptor.kv_heads,
                                  self.descriptor.head_dim)
        for layer in self._layers:
            self.layout.check(layer)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        with self._cond:
            self._loaded = [0] * len(self._layers)
            self._load_count = len(meta.loads)
        for load in meta.loads:
            self.services.submit(self._load(load))

    async def _load(self, load: LoadBlock) -> None:
        assert self.layout is not None
        done = 0
        try:
            async with self.services.fetcher.fetch_layers(load.match, lease_ms=self.settings.lease_ttl_ms) as stream:
                async for layer in stream:
                    self.layout.write_octets(self._layers[layer.index], load.block_id, layer.k_parts, layer.v_parts)
                    with self._cond:
                        self._loaded[layer.index] += 1
                        self._cond.notify_all()
                    done = layer.index + 1
            complete = stream.complete
        except Exception as exc:  # any failure: the block is recomputed
            self._warn_once("load", f"loading block {load.match.block_key.hex()[:16]} failed ({exc}); recomputed")
            complete = False
        with self._cond:
            if not complete or done < len(self._layers):
                self._load_errors.add(load.block_id)
                for i in range(done, len(self._layers)):
                    self._loaded[i] += 1
            self._cond.notify_all()

    def wait_for_layer_load(self, layer_name: str) -> None:
        index = self._layer_of.get(layer_name)
        if index is None or not self._load_count:
            return
        deadline = time.monotonic() + 4 * self.settings.timeout_ms / 1000
        with self._cond:
            while self._loaded[index] < self._load_count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"layer {index}: KVSP loads did not finish in time")
                self._cond.wait(left)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        index = self._layer_of.get(layer_name)
        if index is None or not meta.saves or self.layout is None:
            return
        for save in meta.saves:
            k, v = self.layout.read(kv_layer, save.block_id)
            sections = self._saving.setdefault(save.block_id, [])
            sections.append((k.view(-1).view(dtype=_uint8()).numpy().tobytes(),
                             v.view(-1).view(dtype=_uint8()).numpy().tobytes()))
            if index == len(self._layers) - 1:
                layers = self._saving.pop(save.block_id)
                if len(layers) == len(self._layers):
                    self.services.submit(self._store(save.key, layers))

    async def _store(self, key: bytes, layers: list[tuple[bytes, bytes]]) -> None:
        body = container.encode(layers, first_layer=0, token_count=self.block_size, descriptor=self.descriptor)
        for holder in self.settings.holders:
            try:
                await self.services.api.put_block(holder, self.descriptor.compat_id, self.keyer.scope_id, key,
                                                  body.tobytes())
                return
            except Problem as exc:
                if exc.status == 412:  # the holder has it already
                    return
                self._warn_once("store", f"storing a block at {holder} was refused: {exc.detail}")
                return
            except (RetryElsewhere, OSError) as exc:
                self._warn_once("store", f"storing a block at {holder} failed: {exc}")

    def wait_for_save(self) -> None:
        return  # save_kv_layer copied the blocks out: the cache may be reused at once

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._cond:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self.services.close()

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("KVSP connector: %s", message)


def _uint8() -> Any:
    import torch

    return torch.uint8


__all__ = ["KvspConnector", "KvspMetadata", "LoadBlock", "SaveBlock"]
