"""The engine of an Inference Instance as the instance's asyncio service uses it: typing Protocols and the value
types they exchange. Pure: no torch, no asyncio.

``gpu/engine.py`` implements them (:class:`gpu.engine.Engine` is an :class:`InstanceEngine`,
:class:`gpu.engine.CacheHolder` a :class:`PageHolder`); the composition root (:mod:`kvsp_app`) builds them and
hands them to ``kvsp_runtime.instance_service``, which never imports ``gpu``.

* :class:`PageCache` -- the engine's paged KV cache: pages named by Block Keys, referenced while in use, and
  written layer by layer as blocks arrive.
* :class:`RunPlan` / :class:`SessionHooks` / :class:`RunEnd` -- one session run: what the engine computes, what it
  tells the service while it runs, and how it ended.
* :class:`InstanceEngine` -- the model and its cache on one device.
* :class:`PageHolder` -- the instance as a holder of its own cache's pages.

A page is of the engine's own type (the type variable ``P``): the service keeps and passes back pages, never looks
inside them.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import AsyncIterable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeAlias, TypeVar

from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.container import DecodedLayer
from kvsp_quic.keys import BlockKeyChain
from kvsp_quic.records import ReplicaRecord, Sampler
from kvsp_quic.roles.holder import Holder
from kvsp_quic.roles.instance import EngineFigures

P = TypeVar("P")  # a page of the engine's KV cache
P_contra = TypeVar("P_contra", contravariant=True)

LayerSource = AsyncIterable[DecodedLayer]  # the verified layers of one block, in ascending order, as they arrive
BlockInput: TypeAlias = "P | LayerSource"  # a block of a prefill: a resident page, or its layers as they arrive


class PrefixUnavailable(RuntimeError):
    """A block whose tokens this instance does not know (a resumed prompt) could not be loaded."""


class RunEnd(enum.Enum):
    """Why a session run ended."""

    LENGTH = "length"  # max_new tokens were generated
    STOP = "stop"  # a stop token was generated
    FENCED = "fenced"  # the service stopped it (a newer epoch runs elsewhere)


class PageCache(Protocol[P]):
    """Pages of ``block_tokens`` tokens. A page is referenced while in use (:meth:`acquire` / :meth:`release`); the
    cache evicts only unreferenced pages, and then forgets their Block Keys."""

    @property
    def layers(self) -> int: ...

    def utilization(self) -> float:
        """The share of the device tier in use, 0..1."""
        ...

    def lookup(self, key: bytes) -> P | None:
        """The complete page named *key*, if the cache has one."""
        ...

    def acquire(self, page: P) -> P:
        """One more reference on *page* (KeyError: it was evicted)."""
        ...

    def release(self, page: P) -> None:
        """One reference less (ValueError: none was held)."""
        ...

    def new_page(self) -> P:
        """An empty page, referenced once."""
        ...

    def write_layer(self, page: P, layer: int, k_parts: Sequence[Any], v_parts: Sequence[Any]) -> None:
        """One layer of a block from its kvsp-layout-1 K and V sections (the parts they arrived in)."""
        ...

    def set_key(self, page: P, key: bytes) -> None:
        """Name the complete *page* by its Block Key (lookups find it from now on)."""
        ...


@dataclass
class RunPlan(Generic[P]):
    """What :meth:`InstanceEngine.run` computes.

    The prefill covers ``tokens`` (a resumed session's prompt blocks are placeholders: their K and V must be
    loaded, ``must_load`` blocks), with ``blocks`` for its first blocks; ``keys`` name its complete pages. Then
    ``replay`` tokens are decoded one by one (a resumed session's generated tokens not covered by loaded blocks:
    decoded as they were first decoded, so their K and V, and the logits after them, are bit-identical), then up to
    ``max_new`` tokens are sampled with ``sampler`` (its state at the first of them). ``chain`` holds the Block Keys
    of the sequence up to the end of the prefill and names the pages that complete later. With ``prompt_logprobs``
    the prefill computes every position of ``tokens`` (``blocks`` is empty) and reports each prompt token's log
    probabilities (:attr:`PrefillOutcome.prompt_logprobs`) before the first token is sampled.
    """

    tokens: list[int]
    blocks: list[BlockInput[P]]
    keys: list[bytes]
    chain: BlockKeyChain | None
    sampler: Sampler
    max_new: int
    replay: list[int] = field(default_factory=list)
    must_load: int = 0
    stop: Collection[int] = ()
    load_timeout: float | None = None  # a block still arriving after this long is recomputed
    chain_first_block: int = 0  # the block index of ``chain.keys[0]`` (a resumed session's: after the prompt)
    output: Sequence[int] = ()  # the session's output before the first sampled token (the penalties count it)
    prompt_logprobs: int | None = None  # compute every prompt token's log probability and this many alternatives


Logprobs: TypeAlias = tuple[float, tuple[tuple[int, float], ...]]
"""A sampled token's log probability and the most likely alternatives, (token, log probability), best first."""


class PrefillOutcome(Protocol):
    """What a run's prefill did with its blocks."""

    @property
    def computed_from(self) -> int:
        """The first token of the computed suffix."""
        ...

    @property
    def loaded_blocks(self) -> Sequence[int]:
        """Blocks whose K and V came from the plan's inputs."""
        ...

    @property
    def recomputed_blocks(self) -> Sequence[int]:
        """Inputs that failed and were computed instead."""
        ...

    @property
    def prompt_logprobs(self) -> Sequence[Logprobs | None] | None:
        """When the plan asked for them: per token of the prefill, its :data:`Logprobs` after the tokens before it
        (None for the first token)."""
        ...


class SessionHooks(Protocol[P_contra]):
    """What a run tells its service while it runs."""

    def prefilled(self, result: PrefillOutcome) -> None:
        """The prefill is done (before any token is sampled)."""

    def token(self, token: int, logprobs: Logprobs | None = None) -> bool:
        """A token was sampled (with its :data:`Logprobs` when the sampler's ``logprobs`` asks for them); False
        stops the run (the session was fenced)."""

    def page_complete(self, page: P_contra, key: bytes) -> None:
        """A page of the sequence is complete and named *key* (publish it)."""


class InstanceEngine(Protocol[P]):
    """A model and its paged KV cache on one device."""

    @property
    def cache(self) -> PageCache[P]: ...

    @property
    def descriptor(self) -> CompatDescriptor:
        """The Compatibility Descriptor of the cache's blocks."""
        ...

    @property
    def block_tokens(self) -> int: ...

    @property
    def vocab_size(self) -> int:
        """Token ids are below it."""
        ...

    @property
    def name(self) -> str:
        """The engine that computes (``reference``, ``transformers``: ``[instance] engine``)."""
        ...

    @property
    def build(self) -> str:
        """Its build fingerprint (libraries and versions, device type, KV dtype): two instances whose engines have
        equal names and fingerprints compute bit-identical K, V and logits."""
        ...

    def figures(self) -> EngineFigures:
        """Measured rates and the cache's utilization, for the status record."""
        ...

    def check_sampler(self, sampler: Sampler) -> None:
        """Raise ValueError when the engine cannot sample with *sampler* (method, parameters, seed, step)."""
        ...

    async def digests(self, page: P) -> tuple[bytes, ...]:
        """The layer digests of a complete, referenced page (SHA-256 of K || V per layer)."""
        ...

    async def run(self, plan: RunPlan[P], hooks: SessionHooks[P]) -> RunEnd:
        """Run one session: the prefill, the replayed tokens, then generation, naming every page that completes.
        Raises :class:`PrefixUnavailable` when a block of ``must_load`` could not be loaded."""
        ...


class PageHolder(Holder, abc.ABC, Generic[P]):
    """A :class:`~kvsp_quic.roles.holder.Holder` whose replicas are the named pages of an engine's cache: the
    instance serves, leases and publishes what it loads and computes."""

    @abc.abstractmethod
    def attach(self, call_soon_threadsafe: Callable[..., object]) -> None:
        """Take the cache's eviction and residency callbacks; they may come from the engine thread and are run
        through *call_soon_threadsafe(callback, *args)*."""

    @abc.abstractmethod
    def holds(self, key: bytes) -> bool:
        """Whether the cache has a complete page for *key* (published or about to be)."""

    @abc.abstractmethod
    def adopted(self, key: bytes) -> bool:
        """Whether *key*'s page is served as a replica already."""

    @abc.abstractmethod
    def adopt(self, scope_id: bytes, key: bytes, page: P, layer_digests: Sequence[bytes]) -> ReplicaRecord | None:
        """Serve and publish the named complete *page* as a replica of *key* in *scope_id*."""


__all__ = [
    "BlockInput", "InstanceEngine", "LayerSource", "Logprobs", "PageCache", "PageHolder", "PrefillOutcome",
    "PrefixUnavailable", "RunEnd", "RunPlan", "SessionHooks",
]
