"""The matrix as Markdown, JSON and a self-contained HTML page (a cell per case and implementation)."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

_MARK = {"pass": "pass", "fail": "**FAIL**", "unsupported": "-"}
_COLOUR = {"pass": "#c8e6c9", "fail": "#ffcdd2", "unsupported": "#eeeeee"}


def _grid(cells: list[dict[str, Any]]) -> tuple[list[str], list[str], dict[tuple[str, str], dict[str, Any]]]:
    cases = list(dict.fromkeys(c["case"] for c in cells))
    clients = list(dict.fromkeys(c["client"] for c in cells))
    return cases, clients, {(c["case"], c["client"]): c for c in cells}


def markdown(cells: list[dict[str, Any]], bad_keys: set[str] = frozenset()) -> str:  # type: ignore[assignment]
    cases, clients, by = _grid(cells)
    lines = ["server: kvsp-quic (index + Placement Controller, holder, relay, inference instances: rows ending in "
             "@transformers run --engine transformers); rows: test cases; columns: client implementation-transport", "",
             "| case | " + " | ".join(clients) + " |", "|---|" + "---|" * len(clients)]
    for case in cases:
        row = []
        for client in clients:
            cell = by.get((case, client))
            row.append(_MARK[cell["result"]] if cell else " ")
        lines.append(f"| {case} | " + " | ".join(row) + " |")
    counts = {r: sum(c["result"] == r for c in cells) for r in _MARK}
    lines += ["", f"{counts['pass']} pass, {counts['fail']} fail, {counts['unsupported']} unsupported "
              "(-: the implementation cannot play the case, or no server implements the resource yet)"]
    notes = sorted({(c["case"], c["detail"]) for c in cells if c["result"] == "unsupported" and c["detail"]})
    if notes:
        lines += ["", "Why cells are unsupported:", ""]
        seen: set[str] = set()
        for case, detail in notes:
            if detail not in seen:
                seen.add(detail)
                lines.append(f"- {detail} (e.g. {case})")
    return "\n".join(lines) + "\n"


def page(cells: list[dict[str, Any]]) -> str:
    cases, clients, by = _grid(cells)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in clients)
    rows = []
    for case in cases:
        tds = []
        for client in clients:
            cell = by.get((case, client))
            if cell is None:
                tds.append("<td></td>")
                continue
            title = html.escape(cell["detail"] or cell["result"])
            tds.append(f'<td style="background:{_COLOUR[cell["result"]]}" title="{title}">'
                       f'<a href="{html.escape(cell["log"])}">{cell["result"]}</a></td>')
        rows.append(f"<tr><th style='text-align:left'>{html.escape(case)}</th>{''.join(tds)}</tr>")
    return ("<!doctype html><meta charset=utf-8><title>kvsp-quic interop matrix</title>"
            "<style>body{font-family:sans-serif}td,th{border:1px solid #999;padding:4px 8px}"
            "table{border-collapse:collapse}a{color:inherit}</style>"
            "<h1>kvsp-quic interop matrix</h1><p>server: kvsp-quic; hover a cell for details, click for its log</p>"
            f"<table><tr><th>case</th>{head}</tr>{''.join(rows)}</table>")


def write(out: Path, cells: list[dict[str, Any]], bad_keys: set[str] = frozenset()) -> None:  # type: ignore[assignment]
    out.mkdir(parents=True, exist_ok=True)
    (out / "matrix.md").write_text(markdown(cells, bad_keys))
    (out / "matrix.json").write_text(json.dumps(cells, indent=1) + "\n")
    (out / "matrix.html").write_text(page(cells))
