"""kvsp_quic.metrics: the Prometheus text format 0.0.4, families, collectors, the shared KVSP families; and the
``/metrics`` route helper with transfer counting (http3.metrics_app), driven as a plain ASGI app."""

from __future__ import annotations

import collections
import math
import re
from pathlib import Path

import pytest
from starlette.applications import Starlette

from http3.app_kit import role_app
from http3.authz import Rule
from http3.metrics_app import TransferMetrics, mount_metrics
from kvsp_quic.auth import Policy
from kvsp_quic.metrics import (
    CONTENT_TYPE,
    KvspMetrics,
    Registry,
    format_value,
    holder_collectors,
    retrieval_collectors,
)
from kvsp_quic.retrieval_plan import RetrievalMetrics
from quic import pki
from tests.asgi import call, http_scope

# One line of the text format: name, optional labels, value (no timestamps are written).
_SAMPLE = re.compile(r'[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="(\\.|[^"\\])*",?)*\})? \S+')


def check_format(text: str) -> dict[str, float]:
    """Validate *text* line by line and return ``{series: value}``."""
    assert text.endswith("\n")
    out: dict[str, float] = {}
    typed: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            name, kind = line[7:].split(" ")
            assert kind in ("counter", "gauge", "histogram", "untyped")
            assert name not in typed
            typed.add(name)
            continue
        assert _SAMPLE.fullmatch(line), line
        series, value = line.rsplit(" ", 1)
        assert series not in out, f"duplicate series {series}"
        out[series] = float(value.replace("+Inf", "inf"))
    return out


def test_counter_gauge_histogram_render() -> None:
    reg = Registry()
    c = reg.counter("kvsp_things_total", "Things\ncounted \\ here", ("kind",))
    c.labels(kind='a"b\\c\nd').inc(2)
    c.labels(kind="plain").inc()
    g = reg.gauge("kvsp_level", "A level")
    g.set(0.25)
    h = reg.histogram("kvsp_seconds", "Durations", buckets=(0.1, 1.0))
    for v in (0.05, 0.5, 0.5, 3.0):
        h.observe(v)
    text = reg.render()
    samples = check_format(text)
    assert "# HELP kvsp_things_total Things\\ncounted \\\\ here" in text
    assert samples['kvsp_things_total{kind="a\\"b\\\\c\\nd"}'] == 2
    assert samples['kvsp_things_total{kind="plain"}'] == 1
    assert samples["kvsp_level"] == 0.25
    assert samples['kvsp_seconds_bucket{le="0.1"}'] == 1
    assert samples['kvsp_seconds_bucket{le="1"}'] == 3
    assert samples['kvsp_seconds_bucket{le="+Inf"}'] == 4
    assert samples["kvsp_seconds_count"] == 4
    assert samples["kvsp_seconds_sum"] == pytest.approx(4.05)
    assert text.index("kvsp_level") < text.index("kvsp_seconds") < text.index("kvsp_things_total")


def test_registry_rules() -> None:
    reg = Registry()
    assert reg.render() == ""
    c = reg.counter("a_total", "x", ("l",))
    assert reg.counter("a_total", "x", ("l",)) is c  # shared by name
    with pytest.raises(ValueError):
        reg.gauge("a_total", "x", ("l",))
    with pytest.raises(ValueError):
        reg.counter("a_total", "x", ("other",))
    with pytest.raises(ValueError):
        reg.counter("no_suffix", "x")
    with pytest.raises(ValueError):
        reg.counter("bad-name_total", "x")
    with pytest.raises(ValueError):
        reg.counter("b_total", "x", ("__reserved",))
    with pytest.raises(ValueError):
        c.labels(wrong="1")
    with pytest.raises(ValueError):
        c.labels(l="1").inc(-1)
    with pytest.raises(TypeError):
        reg.histogram("h", "x").collect(lambda: [])
    with pytest.raises(ValueError):
        reg.histogram("h2", "x", buckets=(2.0, 1.0))


def test_collectors_sum_with_series() -> None:
    reg = Registry()
    c = reg.counter("x_total", "x", ("component",))
    c.labels(component="a").inc(1)
    c.collect(lambda: [({"component": "a"}, 2), ({"component": "b"}, 5)])
    g = reg.gauge("y", "y", ("component",))
    g.labels(component="a").set(1)
    g.collect(lambda: [({"component": "a"}, 7)])
    samples = check_format(reg.render())
    assert samples['x_total{component="a"}'] == 3
    assert samples['x_total{component="b"}'] == 5
    assert samples['y{component="a"}'] == 7  # gauges: the last value wins


def test_format_value() -> None:
    assert format_value(3.0) == "3"
    assert format_value(0.5) == "0.5"
    assert format_value(math.inf) == "+Inf"
    assert format_value(-math.inf) == "-Inf"
    assert format_value(math.nan) == "NaN"


def test_kvsp_families_hit_ratio() -> None:
    reg = Registry()
    kvsp = KvspMetrics(reg)
    KvspMetrics(reg)  # a second view of the same families does not add a second ratio collector
    kvsp.lookup("index", 10, 7)
    kvsp.lookup("index", 10, 3)
    kvsp.lookup("controller", 4, 4)
    kvsp.migrations.labels(component="controller").inc()
    samples = check_format(reg.render())
    assert samples['kvsp_lookup_hit_ratio{component="index"}'] == 0.5
    assert samples['kvsp_lookup_hit_ratio{component="controller"}'] == 1.0
    assert samples['kvsp_lookups_total{component="index"}'] == 2
    assert samples['kvsp_migrations_total{component="controller"}'] == 1


def test_holder_and_retrieval_collectors() -> None:
    reg = Registry()
    counters: collections.Counter[str] = collections.Counter(stored=3, lease_rejections=2, faults=1)
    holder_collectors(reg, counters)
    m = RetrievalMetrics(lookups=2, lookup_keys=8, lookup_matched=6, hits=5, misses=3, leases_refused=1,
                         digest_failures=4)
    m.add_bytes("HTTP/3", 1000)
    m.add_bytes("HTTP/1.1", 10)
    retrieval_collectors(reg, m, block_tokens=16)
    counters["lease_rejections"] += 1  # read at scrape time
    samples = check_format(reg.render())
    assert samples['kvsp_holder_events_total{event="stored"}'] == 3
    assert samples['kvsp_lease_rejections_total{component="holder"}'] == 3
    assert samples['kvsp_lease_rejections_total{component="retrieval"}'] == 1
    assert samples['kvsp_digest_failures_total{component="holder"}'] == 1
    assert samples['kvsp_digest_failures_total{component="retrieval"}'] == 4
    assert samples['kvsp_fetched_tokens_total{component="retrieval"}'] == 80
    assert samples['kvsp_recomputed_tokens_total{component="retrieval"}'] == 48
    assert samples['kvsp_lookup_hit_ratio{component="retrieval"}'] == 0.75
    assert samples['kvsp_transfer_bytes_total{component="retrieval",transport="HTTP/3",direction="in"}'] == 1000
    assert samples['kvsp_retrieval_blocks_total{component="retrieval",outcome="miss"}'] == 3


async def test_metrics_route_authorized_for_any_principal(tmp_path: Path) -> None:
    root = tmp_path
    pki.init(root, [pki.client("scraper"), pki.client("stranger")])
    pem = (root / "scraper.pem").read_text()
    stranger = (root / "stranger.pem").read_text()
    policy = Policy.from_dict({"principal": [{"identity": "urn:kvsp:client:scraper", "roles": ["client"]}]})
    reg = Registry()
    KvspMetrics(reg).migrations.labels(component="controller").inc()
    app = Starlette(routes=[])
    rules = mount_metrics(app, reg, (Rule("GET", "other", ["holder"]),))
    asgi = TransferMetrics(role_app(app, policy, rules, "/kvsp/"), reg, component="test")
    sent = await call(asgi, http_scope("GET", "/kvsp/metrics", pem=pem))
    assert sent.status == 200
    assert sent.headers["content-type"] == CONTENT_TYPE
    assert sent.headers["cache-control"] == "no-store"
    assert 'kvsp_migrations_total{component="controller"} 1' in sent.body.decode()
    again = await call(asgi, http_scope("GET", "/kvsp/metrics", pem=pem))
    samples = check_format(again.body.decode())
    assert samples['kvsp_transfer_bytes_total{component="test",transport="HTTP/2",direction="out"}'] == len(sent.body)
    assert (await call(asgi, http_scope("GET", "/kvsp/metrics", pem=stranger))).status == 403  # not in the policy
    assert (await call(asgi, http_scope("GET", "/kvsp/metrics"))).status == 403  # no certificate
