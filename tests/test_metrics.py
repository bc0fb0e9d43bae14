"""kvsp_quic.metrics: families on prometheus_client, scrape-time sources, the shared KVSP families, one registry per
role; and the ``/metrics`` route (text format 0.0.4 or OpenMetrics by ``Accept``) with transfer counting
(kvsp_http.metrics_app), driven as a plain ASGI app. Outcomes are read back from real scrapes with the library's
parsers."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import prometheus_client as prom
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from starlette.applications import Starlette

from kvsp_dev import pki
from kvsp_http.app_kit import role_app
from kvsp_http.authz import Rule
from kvsp_http.metrics_app import OPENMETRICS_CONTENT_TYPE, TransferMetrics, mount_metrics, negotiate
from kvsp_quic.auth import Policy
from kvsp_quic.metrics import (
    CONTENT_TYPE,
    KvspMetrics,
    Registry,
    holder_collectors,
    retrieval_collectors,
)
from kvsp_quic.retrieval_plan import RetrievalMetrics
from tests.asgi import call, http_scope
from tests.support.metrics import check_format, families


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
    assert "# HELP kvsp_things_total Things\\ncounted \\\\ here\n# TYPE kvsp_things_total counter\n" in text
    assert samples['kvsp_things_total{kind="a\\"b\\\\c\\nd"}'] == 2
    assert samples['kvsp_things_total{kind="plain"}'] == 1
    assert samples["kvsp_level"] == 0.25
    assert samples['kvsp_seconds_bucket{le="0.1"}'] == 1
    assert samples['kvsp_seconds_bucket{le="1.0"}'] == 3
    assert samples['kvsp_seconds_bucket{le="+Inf"}'] == 4
    assert samples["kvsp_seconds_count"] == 4
    assert samples["kvsp_seconds_sum"] == pytest.approx(4.05)
    parsed = families(text)
    assert {name: (f.type, f.documentation) for name, f in parsed.items()} == {
        "kvsp_things": ("counter", "Things\ncounted \\ here"),  # the library's family name of kvsp_things_total
        "kvsp_level": ("gauge", "A level"),
        "kvsp_seconds": ("histogram", "Durations"),
    }
    assert {s.labels["kind"] for s in parsed["kvsp_things"].samples} == {'a"b\\c\nd', "plain"}  # round trip


def test_registry_rules() -> None:
    reg = Registry()
    assert reg.render() == ""
    c = reg.counter("a_total", "x", ("l",))
    assert reg.counter("a_total", "x", ("l",)) is c  # shared by name
    assert "a_total" in reg and "b_total" not in reg
    with pytest.raises(ValueError):
        reg.gauge("a_total", "x", ("l",))
    with pytest.raises(ValueError):
        reg.counter("a_total", "x", ("other",))
    with pytest.raises(ValueError):
        reg.counter("no_suffix", "x")
    with pytest.raises(ValueError):
        reg.counter("bad-name_total", "x")  # the library alone would take UTF-8 names; format 0.0.4 does not
    with pytest.raises(ValueError):
        reg.counter("b_total", "x", ("__reserved",))
    with pytest.raises(ValueError):
        reg.gauge("a_created", "x")  # the library's registry: the name is the counter a_total's
    with pytest.raises(ValueError):
        prom.Gauge("a", "x", registry=reg)  # any collector of the library is checked against the families
    with pytest.raises(ValueError):
        c.labels(wrong="1")
    with pytest.raises(ValueError):
        c.labels(l="1").inc(-1)
    with pytest.raises(TypeError):
        reg.histogram("h", "x").collect(lambda: [])
    with pytest.raises(ValueError):
        reg.histogram("h2", "x", buckets=(2.0, 1.0))
    assert check_format(reg.render()) == {'a_total{l="1"}': 0, "h_count": 0, "h_sum": 0,
                                          **{f'h_bucket{{le="{le}"}}': 0 for le in (
                                              "0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1", "0.25",
                                              "0.5", "1.0", "2.5", "5.0", "10.0", "+Inf")}}


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
    assert reg.samples("x_total") == {(("component", "a"),): 3, (("component", "b"),): 5}
    assert reg.get_sample_value("x_total", {"component": "b"}) == 5  # the library's own reader agrees
    with pytest.raises(KeyError):
        reg.samples("nothing_total")


def test_registries_are_independent() -> None:
    one, two = Registry(), Registry()
    KvspMetrics(one).migrations.labels(component="controller").inc(3)
    KvspMetrics(two).migrations.labels(component="controller").inc()
    holder_collectors(two, {"stored": 4})
    assert check_format(one.render())['kvsp_migrations_total{component="controller"}'] == 3
    scraped = check_format(two.render())
    assert scraped['kvsp_migrations_total{component="controller"}'] == 1
    assert scraped['kvsp_holder_events_total{event="stored"}'] == 4
    assert "kvsp_holder_events_total" not in one
    # nothing lands in the library's global default registry
    assert prom.REGISTRY.get_sample_value("kvsp_migrations_total", {"component": "controller"}) is None
    assert "kvsp_migrations" not in families(prom.generate_latest(prom.REGISTRY).decode())


def test_kvsp_families_hit_ratio() -> None:
    reg = Registry()
    kvsp = KvspMetrics(reg)
    KvspMetrics(reg)  # a second view of the same families does not add a second ratio source
    kvsp.lookup("index", 10, 7)
    kvsp.lookup("index", 10, 3)
    kvsp.lookup("controller", 4, 4)
    kvsp.migrations.labels(component="controller").inc()
    text = reg.render()
    samples = check_format(text)
    assert samples['kvsp_lookup_hit_ratio{component="index"}'] == 0.5
    assert samples['kvsp_lookup_hit_ratio{component="controller"}'] == 1.0
    assert samples['kvsp_lookups_total{component="index"}'] == 2
    assert samples['kvsp_migrations_total{component="controller"}'] == 1
    # every shared family, with its type and HELP, whether it has samples yet or not
    types = {f"# TYPE {name} {kind}" for name, kind in [
        ("kvsp_lookups_total", "counter"), ("kvsp_lookup_keys_total", "counter"),
        ("kvsp_lookup_matched_keys_total", "counter"), ("kvsp_lookup_hit_ratio", "gauge"),
        ("kvsp_fetched_tokens_total", "counter"), ("kvsp_recomputed_tokens_total", "counter"),
        ("kvsp_lease_rejections_total", "counter"), ("kvsp_digest_failures_total", "counter"),
        ("kvsp_migrations_total", "counter"), ("kvsp_transfer_bytes_total", "counter")]}
    assert {line for line in text.splitlines() if line.startswith("# TYPE")} == types
    assert "# HELP kvsp_transfer_bytes_total Body octets by transport and direction\n" in text


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
    assert samples['kvsp_transfer_bytes_total{component="retrieval",direction="in",transport="HTTP/3"}'] == 1000
    assert samples['kvsp_retrieval_blocks_total{component="retrieval",outcome="miss"}'] == 3
    m.hits += 1
    assert check_format(reg.render())['kvsp_retrieval_blocks_total{component="retrieval",outcome="hit"}'] == 6


def test_retrieval_collectors_export_the_producer_digest_counters() -> None:
    reg = Registry()
    m = RetrievalMetrics(producer_mismatches=3, producer_unverified=5, producer_lookup_errors=1)
    retrieval_collectors(reg, m, component="instance")
    text = reg.render()
    samples = check_format(text)
    assert samples['kvsp_producer_digest_mismatches_total{component="instance"}'] == 3
    assert samples['kvsp_producer_digest_unverified_blocks_total{component="instance"}'] == 5
    assert samples['kvsp_producer_digest_lookup_errors_total{component="instance"}'] == 1
    assert "# TYPE kvsp_producer_digest_mismatches_total counter" in text
    m.producer_mismatches += 2  # read at scrape time
    assert check_format(reg.render())['kvsp_producer_digest_mismatches_total{component="instance"}'] == 5


@pytest.mark.parametrize(("accept", "openmetrics"), [
    (None, False),
    ("*/*", False),
    ("text/plain; version=0.0.4", False),
    ("application/openmetrics-text", True),
    # Prometheus 2 and 3 by default
    ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1", True),
    ("application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,application/openmetrics-text;"
     "version=0.0.1;q=0.5,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,"
     "*/*;q=0.2", True),
    ("text/plain;version=0.0.4;q=1,application/openmetrics-text;q=0.5", False),
    ("application/openmetrics-text;q=0", False),
])
def test_negotiate(accept: str | None, openmetrics: bool) -> None:
    assert negotiate(accept)[1] == (OPENMETRICS_CONTENT_TYPE if openmetrics else CONTENT_TYPE)


def _app(tmp_path: Path) -> tuple[Any, Registry, str, str]:
    pki.init(tmp_path, [pki.client("scraper"), pki.client("stranger")])
    policy = Policy.from_dict({"principal": [{"identity": "urn:kvsp:client:scraper", "roles": ["client"]}]})
    reg = Registry()
    KvspMetrics(reg).migrations.labels(component="controller").inc()
    app = Starlette(routes=[])
    rules = mount_metrics(app, reg, (Rule("GET", "other", ["holder"]),))
    asgi = TransferMetrics(role_app(app, policy, rules, "/kvsp/"), reg, component="test")
    return asgi, reg, (tmp_path / "scraper.pem").read_text(), (tmp_path / "stranger.pem").read_text()


async def test_metrics_route_authorized_for_any_principal(tmp_path: Path) -> None:
    asgi, _, pem, stranger = _app(tmp_path)
    sent = await call(asgi, http_scope("GET", "/kvsp/metrics", pem=pem))
    assert sent.status == 200
    assert sent.headers["content-type"] == CONTENT_TYPE
    assert sent.headers["cache-control"] == "no-store"
    assert sent.headers["vary"] == "Accept"
    assert check_format(sent.body.decode())['kvsp_migrations_total{component="controller"}'] == 1
    again = await call(asgi, http_scope("GET", "/kvsp/metrics", pem=pem))
    samples = check_format(again.body.decode())
    assert samples['kvsp_transfer_bytes_total{component="test",direction="out",transport="HTTP/2"}'] == len(sent.body)
    assert (await call(asgi, http_scope("GET", "/kvsp/metrics", pem=stranger))).status == 403  # not in the policy
    assert (await call(asgi, http_scope("GET", "/kvsp/metrics"))).status == 403  # no certificate


async def test_metrics_route_openmetrics(tmp_path: Path) -> None:
    asgi, reg, pem, _ = _app(tmp_path)
    reg.histogram("kvsp_seconds", "Durations", buckets=(0.1, 1.0)).observe(0.5)
    scope = http_scope("GET", "/kvsp/metrics", pem=pem)
    scope["headers"].append((b"accept", b"application/openmetrics-text;version=1.0.0,text/plain;q=0.5"))
    sent = await call(asgi, scope)
    assert sent.status == 200 and sent.headers["content-type"] == OPENMETRICS_CONTENT_TYPE
    text = sent.body.decode()
    assert text.endswith("# EOF\n")
    parsed = {f.name: f for f in parse_openmetrics(text)}  # the strict OpenMetrics parser
    assert parsed["kvsp_migrations"].type == "counter"
    migrations = parsed["kvsp_migrations"].samples
    assert [(s.name, s.labels, s.value) for s in migrations] == [
        ("kvsp_migrations_total", {"component": "controller"}, 1.0)]  # no _created sample
    assert parsed["kvsp_lookup_hit_ratio"].type == "gauge"
    assert {s.name: s.value for s in parsed["kvsp_seconds"].samples if "le" not in s.labels} == {
        "kvsp_seconds_count": 1.0, "kvsp_seconds_sum": 0.5}
    # the same families as the text format
    assert set(parsed) == set(families(reg.render()))
