"""The Prometheus text format, checked: every sample line parsed back, none twice."""

from __future__ import annotations

import re

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

# One sample line of the text format: a classic name, optional labels, a value (no timestamps are written).
_SAMPLE = re.compile(r'[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="(\\.|[^"\\])*",?)*\})? \S+')


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def series_key(name: str, labels: dict[str, str]) -> str:
    """A series as the text format writes it: ``name{a="x",b="y"}``, label names in sorted order."""
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items())) + "}"


def families(text: str) -> dict[str, Metric]:
    """The families of a text-format (0.0.4) scrape, parsed by ``prometheus_client``, by family name."""
    return {f.name: f for f in text_string_to_metric_families(text)}


def check_format(text: str) -> dict[str, float]:
    """Validate a text-format (0.0.4) scrape and return ``{series: value}`` (keys as :func:`series_key` writes
    them); every sample line must be parsed back, none twice, no ``_created`` samples."""
    assert text.endswith("\n") or text == ""
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    for line in lines:
        assert _SAMPLE.fullmatch(line), line
    typed = [line.split(" ")[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(typed) == len(set(typed)), "a family typed twice"
    out: dict[str, float] = {}
    for family in families(text).values():
        assert family.type in ("counter", "gauge", "histogram", "unknown")
        for sample in family.samples:
            key = series_key(sample.name, sample.labels)
            assert key not in out, f"duplicate series {key}"
            assert not sample.name.endswith("_created"), key
            out[key] = sample.value
    assert len(out) == len(lines)  # every sample line round-trips
    return out
