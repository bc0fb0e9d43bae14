"""Metrics on ``prometheus_client``: one registry per role (and per test), families, scrape-time sources.

Spec, Operational Considerations: "Implementations SHOULD report lookup hit ratio, fetched versus recomputed
tokens, lease rejections, digest failures, and migrations." Every role keeps a :class:`Registry` (a
``prometheus_client.CollectorRegistry``, never the library's global default one); its HTTP app serves it at
``GET {base}metrics`` (:mod:`kvsp_http.metrics_app`: ``generate_latest``, text format 0.0.4, or OpenMetrics 1.0.0 when
the scraper's ``Accept`` asks for it).

    registry = Registry()
    kvsp = KvspMetrics(registry)                      # the families every role shares (names below)
    kvsp.migrations.labels(component="controller").inc()
    seconds = registry.histogram("kvsp_placement_seconds", "Time to place a session", buckets=(0.01, 0.1, 1))
    seconds.observe(0.004)
    registry.counter("kvsp_holder_events_total", "...", ("event",)).collect(
        lambda: [({"event": k}, v) for k, v in holder.metrics.items()])   # read at scrape time
    text = registry.render()                          # == generate_latest(registry).decode()

A family (:class:`Counter`, :class:`Gauge`, :class:`Histogram`) is a ``prometheus_client`` metric of the same type,
created with ``registry=None`` (the family registers itself, see below), that counts in place -- ``labels(...)``
returns the library's own child, with its locking, validation and value storage -- plus *sources*: callables read at
every scrape that yield ``[(labels, value), ...]``, so existing counters (``Holder.metrics``, ``RetrievalMetrics``,
the controller's session table) are read, not mirrored. Each family is registered in its registry as one
``prometheus_client`` collector (:class:`FamilyCollector`) that yields one ``Metric`` with the series and the
sources merged: counter samples with equal labels are **summed** (two sources can feed one series), gauges take the
source's value (the last wins).

Exposed names are today's names: a counter is asked for with its full name (``kvsp_lookups_total``; the library's
family name drops the suffix, the text format writes it back on ``HELP``/``TYPE`` and the samples). The library's
``_created`` samples (counters, histograms) are left out, per registry (no global
``disable_created_metrics()``): no scrape had them, and a role restarts its counters with the process anyway.
Names and label names are checked against the classic charset (``[a-zA-Z_:][a-zA-Z0-9_:]*``), which the text
format 0.0.4 needs; the library alone would accept UTF-8 names.

Multiprocess aggregation (issue 14, not done): with ``PROMETHEUS_MULTIPROC_DIR`` set before ``prometheus_client``
is imported, the families' metrics keep their values in the library's per-process files unchanged. The scraping
process would then register ``prometheus_client.multiprocess.MultiProcessCollector`` in the role's registry and let
the families yield only their sources' samples, merged with the aggregated series by family name (gauges choose a
``multiprocess_mode``): the families are the one place samples are merged, so nothing at the call sites changes.

The shared KVSP families (:class:`KvspMetrics`), each with a ``component`` label naming who counted
(``index``, ``controller``, ``holder``, ``instance``, ``retrieval``, ...):

=====================================  =========  ===========================================================
``kvsp_lookups_total``                 counter    lookups answered (index) or sent (retrieval)
``kvsp_lookup_keys_total``             counter    block keys looked up
``kvsp_lookup_matched_keys_total``     counter    block keys matched (the leading keys with a replica)
``kvsp_lookup_hit_ratio``              gauge      matched keys / looked-up keys since start, per component
``kvsp_fetched_tokens_total``          counter    tokens whose KV cache was loaded instead of computed
``kvsp_recomputed_tokens_total``       counter    tokens whose KV cache was computed (prefill)
``kvsp_lease_rejections_total``        counter    leases refused (holder: refused; retrieval: was refused)
``kvsp_digest_failures_total``         counter    data that did not match its digest
``kvsp_migrations_total``              counter    sessions resumed on another instance
``kvsp_transfer_bytes_total``          counter    body octets, labels ``transport`` (HTTP/3, HTTP/2, HTTP/1.1,
                                                  moqt) and ``direction`` (in, out)
=====================================  =========  ===========================================================
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, Generic, TypeVar

import prometheus_client as prom
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DEFAULT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")

Labels = tuple[tuple[str, str], ...]
"""A series' label values, in the family's label-name order: ``(("component", "index"),)``."""
Collected = Iterable[tuple[Mapping[str, str], float]]
"""What a source yields at a scrape: ``[(labels, value), ...]``, labels a mapping of the family's label names."""
Source = Callable[[], Collected]

M = TypeVar("M", prom.Counter, prom.Gauge, prom.Histogram)


class Family(Generic[M]):
    """A metric family: a name, a help text, label names, a ``prometheus_client`` metric holding the series counted
    in place, and sources read at every scrape."""

    kind: ClassVar[str]

    def __init__(self, name: str, help: str, labelnames: Sequence[str], metric: M) -> None:
        self.name = name
        self.help = help
        self.labelnames = tuple(labelnames)
        self.metric: M = metric
        self._sources: list[Source] = []
        self._lock = threading.Lock()

    def _key(self, values: Mapping[str, str]) -> Labels:
        if set(values) != set(self.labelnames):
            raise ValueError(f"metric {self.name}: labels {sorted(values)} are not {sorted(self.labelnames)}")
        return tuple((name, str(values[name])) for name in self.labelnames)

    def labels(self, **values: str) -> M:
        """The series with these label values (created at zero on first use): the library's child metric."""
        self._key(values)
        if not self.labelnames:
            return self.metric
        child: M = self.metric.labels(**values)
        return child

    def collect(self, fn: Source) -> None:
        """Read samples from *fn* at every scrape: ``[(labels, value), ...]``, labels as a mapping of this
        family's label names (for histograms: not supported)."""
        with self._lock:
            self._sources.append(fn)

    def _merge(self, old: float | None, new: float) -> float:
        return new if old is None else old + new

    def _series(self) -> dict[Labels, Sample]:
        """The metric's own samples (not ``_created``) by label set."""
        return {self._key(s.labels): s for m in self.metric.collect() for s in m.samples if s.name == self.name}

    def _merged(self) -> dict[Labels, Sample]:
        samples = self._series()
        with self._lock:
            sources = list(self._sources)
        for fn in sources:
            for labels, value in fn():
                key = self._key(labels)
                old = samples.get(key)
                if old is None:
                    samples[key] = Sample(self.name, dict(key), self._merge(None, float(value)))
                else:
                    samples[key] = old._replace(value=self._merge(old.value, float(value)))
        return samples

    def values(self) -> dict[Labels, float]:
        """The current samples: the series' values merged with what the sources yield."""
        return {key: s.value for key, s in self._merged().items()}

    @property
    def family_name(self) -> str:
        """The name of the family in the library's (OpenMetrics) model: a counter's without ``_total``."""
        return self.name

    def exposed(self) -> Metric:
        """This family as the library exposes it: one ``Metric``, its samples in label order."""
        metric = Metric(self.family_name, self.help, self.kind)
        metric.samples = [s for _, s in sorted(self._merged().items(), key=lambda item: item[0])]
        return metric


class Counter(Family[prom.Counter]):
    """A counter family; its name ends with ``_total`` and is exposed as given."""

    kind = "counter"

    @property
    def family_name(self) -> str:
        return self.name.removesuffix("_total")

    def inc(self, amount: float = 1.0) -> None:
        """Increment the unlabelled series (a family without label names)."""
        self.labels().inc(amount)


class Gauge(Family[prom.Gauge]):
    """A gauge family; a source's value replaces the series' value for the same labels."""

    kind = "gauge"

    def _merge(self, old: float | None, new: float) -> float:
        return new

    def set(self, value: float) -> None:
        """Set the unlabelled series (a family without label names)."""
        self.labels().set(value)


class Histogram(Family[prom.Histogram]):
    """A fixed-bucket histogram family (``_bucket`` with ``le``, ``_sum``, ``_count``); observations only."""

    kind = "histogram"

    def observe(self, value: float) -> None:
        """Observe into the unlabelled series (a family without label names)."""
        self.labels().observe(value)

    def collect(self, fn: Source) -> None:
        raise TypeError("histograms take observations, not collectors")

    def values(self) -> dict[Labels, float]:
        raise TypeError("a histogram has no single value per series")

    def exposed(self) -> Metric:
        metric = Metric(self.family_name, self.help, self.kind)
        created = self.name + "_created"
        metric.samples = [s for m in self.metric.collect() for s in m.samples if s.name != created]
        return metric


class FamilyCollector(Collector):
    """The ``prometheus_client`` collector of one family: describes its name (so the registry refuses a clashing
    collector) and yields the family, series and sources merged, at every scrape."""

    def __init__(self, family: Counter | Gauge | Histogram) -> None:
        self.family = family

    def describe(self) -> Iterable[Metric]:
        return [Metric(self.family.family_name, self.family.help, self.family.kind)]

    def collect(self) -> Iterable[Metric]:
        return [self.family.exposed()]


F = TypeVar("F", Counter, Gauge, Histogram)


class Registry(CollectorRegistry):
    """The metric families of one role: a ``prometheus_client`` registry of its own (anything the library can
    expose or register works with it) that creates families once and hands them out by name.

    Asking again for an existing name returns the same family when the kind and label names agree (so several
    components can share ``kvsp_*`` families), and raises ``ValueError`` otherwise."""

    def __init__(self) -> None:
        super().__init__()
        self._families_lock = threading.Lock()
        self._families: dict[str, Counter | Gauge | Histogram] = {}
        self._markers: set[str] = set()

    def _family(self, cls: type[F], name: str, help: str, labelnames: Sequence[str],
                metric: Callable[[], Any]) -> F:
        if not _NAME_RE.fullmatch(name):
            raise ValueError(f"bad metric name {name!r}")
        for label in labelnames:
            if not _LABEL_RE.fullmatch(label) or label.startswith("__") or label == "le":
                raise ValueError(f"metric {name}: bad label name {label!r}")
        if len(set(labelnames)) != len(labelnames):
            raise ValueError(f"metric {name}: duplicate label names")
        with self._families_lock:
            found = self._families.get(name)
            if found is not None:
                if not isinstance(found, cls) or found.labelnames != tuple(labelnames):
                    raise ValueError(f"metric {name} exists as a {found.kind} with labels {found.labelnames}")
                return found
            family = cls(name, help, labelnames, metric())
            self.register(FamilyCollector(family))  # raises ValueError when another collector has the name
            self._families[name] = family
            return family

    def counter(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Counter:
        if not name.endswith("_total"):
            raise ValueError(f"counter {name!r}: counter names end with _total")
        return self._family(Counter, name, help, labelnames,
                            lambda: prom.Counter(name, help, labelnames, registry=None))

    def gauge(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Gauge:
        return self._family(Gauge, name, help, labelnames, lambda: prom.Gauge(name, help, labelnames, registry=None))

    def histogram(self, name: str, help: str, labelnames: Sequence[str] = (),
                  buckets: Sequence[float] = DEFAULT_BUCKETS) -> Histogram:
        return self._family(Histogram, name, help, labelnames,
                            lambda: prom.Histogram(name, help, labelnames, registry=None, buckets=buckets))

    def __contains__(self, name: object) -> bool:
        return name in self._families

    def render(self) -> str:
        """The text exposition (format 0.0.4, ``generate_latest``) of everything registered."""
        return generate_latest(self).decode("utf-8")

    def samples(self, name: str) -> dict[Labels, float]:
        """The current samples of a counter or gauge family (series and sources), for derived gauges and tests."""
        family = self._families.get(name)
        if family is None or isinstance(family, Histogram):
            raise KeyError(name)
        return family.values()

    def once(self, marker: str) -> bool:
        """True the first time *marker* is asked for (installing a derived source once per registry)."""
        with self._families_lock:
            if marker in self._markers:
                return False
            self._markers.add(marker)
            return True


# -- the shared KVSP families ----------------------------------------------------------------------------------


class KvspMetrics:
    """The families of the spec's Operational Considerations, shared by every role (see the module docstring)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        c = ("component",)
        self.lookups = registry.counter("kvsp_lookups_total", "Lookups answered or sent", c)
        self.lookup_keys = registry.counter("kvsp_lookup_keys_total", "Block keys looked up", c)
        self.lookup_matched = registry.counter(
            "kvsp_lookup_matched_keys_total", "Block keys matched (leading keys with an unexpired replica)", c)
        self.lookup_hit_ratio = registry.gauge(
            "kvsp_lookup_hit_ratio", "Matched keys / looked-up keys since start", c)
        self.fetched_tokens = registry.counter(
            "kvsp_fetched_tokens_total", "Tokens whose KV cache was loaded rather than computed", c)
        self.recomputed_tokens = registry.counter(
            "kvsp_recomputed_tokens_total", "Tokens whose KV cache was computed (prefill)", c)
        self.lease_rejections = registry.counter("kvsp_lease_rejections_total", "Leases refused", c)
        self.digest_failures = registry.counter(
            "kvsp_digest_failures_total", "Data that did not match its digest", c)
        self.migrations = registry.counter("kvsp_migrations_total", "Sessions resumed on another instance", c)
        self.transfer_bytes = registry.counter(
            "kvsp_transfer_bytes_total", "Body octets by transport and direction",
            ("component", "transport", "direction"))
        if registry.once("kvsp_lookup_hit_ratio"):
            self.lookup_hit_ratio.collect(self._hit_ratios)

    def _hit_ratios(self) -> Collected:
        keys = self.registry.samples("kvsp_lookup_keys_total")
        matched = self.registry.samples("kvsp_lookup_matched_keys_total")
        return [(dict(k), matched.get(k, 0.0) / n) for k, n in keys.items() if n > 0]

    def lookup(self, component: str, keys: int, matched: int) -> None:
        """Count one lookup of *keys* keys of which *matched* matched."""
        self.lookups.labels(component=component).inc()
        self.lookup_keys.labels(component=component).inc(keys)
        self.lookup_matched.labels(component=component).inc(matched)


def holder_collectors(registry: Registry, counters: Mapping[str, int], *, component: str = "holder") -> None:
    """Expose a holder's event counters (``Holder.metrics``): every event as ``kvsp_holder_events_total{event}``,
    ``lease_rejections`` as ``kvsp_lease_rejections_total`` and ``faults`` (stored data that failed
    verification) as ``kvsp_digest_failures_total``."""
    kvsp = KvspMetrics(registry)
    registry.counter("kvsp_holder_events_total", "Holder events (stored, fetched, evicted, ...)",
                     ("event",)).collect(lambda: [({"event": k}, float(v)) for k, v in sorted(counters.items())])
    kvsp.lease_rejections.collect(lambda: [({"component": component}, float(counters.get("lease_rejections", 0)))])
    kvsp.digest_failures.collect(lambda: [({"component": component}, float(counters.get("faults", 0)))])


def retrieval_collectors(registry: Registry, metrics: Any, *, block_tokens: int | None = None,
                         component: str = "retrieval") -> None:
    """Expose a retrieval client's :class:`~kvsp_quic.retrieval_plan.RetrievalMetrics`: its lookups, blocks
    fetched (hits) and recomputed (misses) -- as tokens when *block_tokens* is given, always as
    ``kvsp_retrieval_blocks_total{outcome}`` --, leases refused, digest failures, body octets by transport, and the
    producer-digest mode's counters: ``kvsp_producer_digest_mismatches_total`` (replicas left out),
    ``kvsp_producer_digest_unverified_blocks_total`` (blocks recomputed for want of a vouched replica) and
    ``kvsp_producer_digest_lookup_errors_total`` (producer-digest lookups that failed)."""
    kvsp = KvspMetrics(registry)
    label = {"component": component}
    kvsp.lookups.collect(lambda: [(label, metrics.lookups)])
    kvsp.lookup_keys.collect(lambda: [(label, metrics.lookup_keys)])
    kvsp.lookup_matched.collect(lambda: [(label, metrics.lookup_matched)])
    kvsp.lease_rejections.collect(lambda: [(label, metrics.leases_refused)])
    kvsp.digest_failures.collect(lambda: [(label, metrics.digest_failures)])
    kvsp.transfer_bytes.collect(lambda: [({"component": component, "transport": t, "direction": "in"}, n)
                                         for t, n in sorted(metrics.bytes_by_transport.items())])
    registry.counter("kvsp_retrieval_blocks_total", "Blocks a retrieval client delivered (hit) or left to "
                     "recompute (miss)", ("component", "outcome")).collect(
        lambda: [({"component": component, "outcome": "hit"}, metrics.hits),
                 ({"component": component, "outcome": "miss"}, metrics.misses)])
    # attempts at a replica that broke off (kvsp-quic chaos: a source killed mid-load shows here; docs/chaos.md)
    registry.counter("kvsp_retrieval_failed_attempts_total", "Attempts at a replica that failed, by kind (transport: "
                     "connection, timeout, a body that broke off; unreachable: of those, the holder was gone)",
                     ("component", "failure")).collect(
        lambda: [({"component": component, "failure": "transport"}, metrics.transport_errors),
                 ({"component": component, "failure": "unreachable"}, metrics.unreachable),
                 ({"component": component, "failure": "server-error"}, metrics.server_errors)])
    # the producer-digest mode (issue 13; docs/wire.md, "Producer digests"): what it left out, and why
    registry.counter("kvsp_producer_digest_mismatches_total", "Replicas left out of lookups because no producer "
                     "digest vouches for them", ("component",)).collect(
        lambda: [(label, metrics.producer_mismatches)])
    registry.counter("kvsp_producer_digest_unverified_blocks_total", "Matched blocks recomputed for want of a "
                     "replica a producer digest vouches for", ("component",)).collect(
        lambda: [(label, metrics.producer_unverified)])
    registry.counter("kvsp_producer_digest_lookup_errors_total", "Producer-digest lookups that failed (every "
                     "matched block of the lookup recomputed)", ("component",)).collect(
        lambda: [(label, metrics.producer_lookup_errors)])
    if block_tokens is not None:
        kvsp.fetched_tokens.collect(lambda: [(label, metrics.hits * block_tokens)])
        kvsp.recomputed_tokens.collect(lambda: [(label, metrics.misses * block_tokens)])


__all__ = [
    "CONTENT_TYPE", "DEFAULT_BUCKETS", "Collected", "Counter", "Family", "FamilyCollector", "Gauge", "Histogram",
    "KvspMetrics", "Labels", "Registry", "Source", "holder_collectors", "retrieval_collectors",
]
