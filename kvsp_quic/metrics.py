"""Metrics in the Prometheus text exposition format 0.0.4, without a dependency.

Spec, Operational Considerations: "Implementations SHOULD report lookup hit ratio, fetched versus recomputed
tokens, lease rejections, digest failures, and migrations." Every role keeps a :class:`Registry`; its HTTP app
serves :meth:`Registry.render` at ``GET {base}metrics`` (:mod:`http3.metrics_app`).

    registry = Registry()
    kvsp = KvspMetrics(registry)                      # the families every role shares (names below)
    kvsp.migrations.labels(component="controller").inc()
    seconds = registry.histogram("kvsp_placement_seconds", "Time to place a session", buckets=(0.01, 0.1, 1))
    seconds.observe(0.004)
    registry.counter("kvsp_holder_events_total", "...", ("event",)).collect(
        lambda: [({"event": k}, v) for k, v in holder.metrics.items()])   # read at scrape time
    text = registry.render()

Why no ``prometheus_client``: the registry is ~250 lines, typed for ``mypy --strict``, has no global state (each
role, and each test, owns its registry), and reads existing counters (``Holder.metrics``, ``RetrievalMetrics``)
through collectors at scrape time instead of mirroring them. Only what the roles use is here: counters, gauges and
fixed-bucket histograms (no summaries, no timestamps, no exemplars, no OpenMetrics).

Families with several sources: a family's series and its collectors may yield the same label set; counter samples
with equal labels are **summed** (so two sources can feed one series), gauges keep the last value.

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

import math
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic, TypeVar

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DEFAULT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")

Labels = tuple[tuple[str, str], ...]
Collected = Iterable[tuple[Mapping[str, str], float]]


def format_value(value: float) -> str:
    """A sample value as the format writes it: integers without a fraction, ``+Inf``, ``-Inf``, ``NaN``."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _label_text(labels: Labels) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels) + "}"


class _Child:
    """One series of a counter or gauge (one set of label values)."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self.value = 0.0


class CounterChild(_Child):
    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        with self._lock:
            self.value += amount


class GaugeChild(_Child):
    def set(self, value: float) -> None:
        with self._lock:
            self.value = float(value)

    def inc(self, amount: float = 1.0) -> None:
        with self._lock:
            self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        with self._lock:
            self.value -= amount


class HistogramChild:
    def __init__(self, lock: threading.Lock, buckets: tuple[float, ...]) -> None:
        self._lock = lock
        self.buckets = buckets
        self.counts = [0] * len(buckets)  # per bucket, not cumulative
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        with self._lock:
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    self.counts[i] += 1
                    break
            self.sum += value
            self.count += 1


C = TypeVar("C", CounterChild, GaugeChild, HistogramChild)


class Family(Generic[C]):
    """A metric family: a name, a help text, label names, its series, and collectors read at scrape time."""

    kind = "untyped"

    def __init__(self, name: str, help: str, labelnames: Sequence[str], lock: threading.Lock) -> None:
        if not _NAME_RE.fullmatch(name):
            raise ValueError(f"bad metric name {name!r}")
        for label in labelnames:
            if not _LABEL_RE.fullmatch(label) or label.startswith("__") or label == "le":
                raise ValueError(f"metric {name}: bad label name {label!r}")
        if len(set(labelnames)) != len(labelnames):
            raise ValueError(f"metric {name}: duplicate label names")
        self.name = name
        self.help = help
        self.labelnames = tuple(labelnames)
        self._lock = lock
        self._children: dict[Labels, C] = {}
        self._collectors: list[Callable[[], Collected]] = []

    def _new_child(self) -> C:
        raise NotImplementedError

    def _key(self, values: Mapping[str, str]) -> Labels:
        if set(values) != set(self.labelnames):
            raise ValueError(f"metric {self.name}: labels {sorted(values)} are not {sorted(self.labelnames)}")
        return tuple((name, str(values[name])) for name in self.labelnames)

    def labels(self, **values: str) -> C:
        """The series with these label values (created at zero on first use)."""
        key = self._key(values)
        with self._lock:
            child = self._children.get(key)
            if child is None:
                child = self._children[key] = self._new_child()
        return child

    def collect(self, fn: Callable[[], Collected]) -> None:
        """Read samples from *fn* at every scrape: ``[(labels, value), ...]``, labels as a mapping of this
        family's label names (for histograms: not supported)."""
        self._collectors.append(fn)

    def _collected(self) -> dict[Labels, float]:
        out: dict[Labels, float] = {}
        for fn in self._collectors:
            for labels, value in fn():
                key = self._key(labels)
                out[key] = self._merge(out.get(key), float(value))
        return out

    def _merge(self, old: float | None, new: float) -> float:
        return new if old is None else old + new

    def render(self, out: list[str]) -> None:
        out.append(f"# HELP {self.name} {_escape_help(self.help)}")
        out.append(f"# TYPE {self.name} {self.kind}")
        self._render_samples(out)

    def values(self) -> dict[Labels, float]:
        """The current samples: the series' values merged with what the collectors yield."""
        with self._lock:
            values: dict[Labels, float] = {k: c.value for k, c in self._children.items() if isinstance(c, _Child)}
        for key, value in self._collected().items():
            values[key] = self._merge(values.get(key), value)
        return values

    def _render_samples(self, out: list[str]) -> None:
        values = self.values()
        for key in sorted(values):
            out.append(f"{self.name}{_label_text(key)} {format_value(values[key])}")


class Counter(Family[CounterChild]):
    kind = "counter"

    def _new_child(self) -> CounterChild:
        return CounterChild(self._lock)

    def inc(self, amount: float = 1.0) -> None:
        """Increment the unlabelled series (a family without label names)."""
        self.labels().inc(amount)


class Gauge(Family[GaugeChild]):
    kind = "gauge"

    def _new_child(self) -> GaugeChild:
        return GaugeChild(self._lock)

    def _merge(self, old: float | None, new: float) -> float:
        return new

    def set(self, value: float) -> None:
        self.labels().set(value)


class Histogram(Family[HistogramChild]):
    kind = "histogram"

    def __init__(self, name: str, help: str, labelnames: Sequence[str], lock: threading.Lock,
                 buckets: Sequence[float]) -> None:
        super().__init__(name, help, labelnames, lock)
        bounds = tuple(float(b) for b in buckets if not math.isinf(b))
        if not bounds or list(bounds) != sorted(set(bounds)):
            raise ValueError(f"metric {name}: buckets must be increasing and non-empty")
        self.buckets = bounds

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self._lock, self.buckets)

    def observe(self, value: float) -> None:
        self.labels().observe(value)

    def collect(self, fn: Callable[[], Collected]) -> None:
        raise TypeError("histograms take observations, not collectors")

    def _render_samples(self, out: list[str]) -> None:
        with self._lock:
            snapshot = [(k, list(c.counts), c.sum, c.count) for k, c in self._children.items()]
        for key, counts, total, count in sorted(snapshot, key=lambda s: s[0]):
            running = 0
            for bound, n in zip(self.buckets, counts, strict=True):
                running += n
                out.append(f"{self.name}_bucket{_label_text((*key, ('le', format_value(bound))))} {running}")
            out.append(f"{self.name}_bucket{_label_text((*key, ('le', '+Inf')))} {count}")
            out.append(f"{self.name}_sum{_label_text(key)} {format_value(total)}")
            out.append(f"{self.name}_count{_label_text(key)} {count}")


F = TypeVar("F", Counter, Gauge, Histogram)


class Registry:
    """The metric families of one process (or one role): create them once, render them at every scrape.

    Asking again for an existing name returns the same family when the kind and label names agree (so several
    components can share ``kvsp_*`` families), and raises ``ValueError`` otherwise."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._families: dict[str, Counter | Gauge | Histogram] = {}
        self._markers: set[str] = set()

    def _get(self, cls: type[F], name: str, help: str, labelnames: Sequence[str], **extra: Any) -> F:
        with self._lock:
            found = self._families.get(name)
            if found is not None:
                if not isinstance(found, cls) or found.labelnames != tuple(labelnames):
                    raise ValueError(f"metric {name} exists as a {found.kind} with labels {found.labelnames}")
                return found
            family = cls(name, help, labelnames, threading.Lock(), **extra)
            self._families[name] = family
            return family

    def counter(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Counter:
        if not name.endswith("_total"):
            raise ValueError(f"counter {name!r}: counter names end with _total")
        return self._get(Counter, name, help, labelnames)

    def gauge(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Gauge:
        return self._get(Gauge, name, help, labelnames)

    def histogram(self, name: str, help: str, labelnames: Sequence[str] = (),
                  buckets: Sequence[float] = DEFAULT_BUCKETS) -> Histogram:
        return self._get(Histogram, name, help, labelnames, buckets=buckets)

    def __contains__(self, name: object) -> bool:
        return name in self._families

    def render(self) -> str:
        """The text exposition (format 0.0.4) of every family, in name order, ending with a newline."""
        out: list[str] = []
        with self._lock:
            families = sorted(self._families.values(), key=lambda fam: fam.name)
        for family in families:
            family.render(out)
        return "\n".join(out) + "\n" if out else ""

    def samples(self, name: str) -> dict[Labels, float]:
        """The current samples of a counter or gauge family (series and collectors), for derived gauges and
        tests."""
        family = self._families.get(name)
        if family is None or isinstance(family, Histogram):
            raise KeyError(name)
        return family.values()

    def once(self, marker: str) -> bool:
        """True the first time *marker* is asked for (installing a derived collector once per registry)."""
        with self._lock:
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
    ``kvsp_retrieval_blocks_total{outcome}`` --, leases refused, digest failures and body octets by transport."""
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
    if block_tokens is not None:
        kvsp.fetched_tokens.collect(lambda: [(label, metrics.hits * block_tokens)])
        kvsp.recomputed_tokens.collect(lambda: [(label, metrics.misses * block_tokens)])


__all__ = [
    "CONTENT_TYPE", "DEFAULT_BUCKETS", "Counter", "CounterChild", "Family", "Gauge", "GaugeChild", "Histogram",
    "HistogramChild", "KvspMetrics", "Registry", "format_value", "holder_collectors", "retrieval_collectors",
]
