"""A holder's journal of the replicas it may have advertised, kept in its local-storage directory.

The Index Service has no "every record of this holder" resource (spec, "KVSP Resources": records are published and
withdrawn one key at a time), so a holder that restarts must know by itself which records it may have left there:
the blocks it stored (each is published) and has not yet seen withdrawn. On start it withdraws those it did not
recover and publishes those it did (``Holder.recover``, docs/wire.md "Holder"), so it never advertises what it
cannot serve. The journal also keeps each block's declared chain position, which the files do not carry, so
prefix-aware eviction survives the restart.

Format: text lines appended to ``replicas.journal`` (0600): ``+ <file name stem> [<K[0] hex>:<position>]`` when a
block is stored, ``- <file name stem>`` once its record is known to be gone; the last line of a file cut short by
a crash, and any line that does not parse, are ignored. Lines are buffered and written by :meth:`sync`, which the
holder calls before it sends any publication (so a "+" is on disk before its record can exist); the file is
rewritten compactly when it holds many more lines than live entries.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from kvsp_quic.storage.tiers import BlockId, ChainPosition

log = logging.getLogger("kvsp.journal")

NAME = "replicas.journal"


def _stem(block: BlockId) -> str:
    return f"{block.compat_id.hex()}.{block.scope_id.hex()}.{block.block_key.hex()}"


def _block(stem: str) -> BlockId:
    compat, scope, key = stem.split(".")
    if len(compat) != 64 or len(scope) != 32 or len(key) != 64:
        raise ValueError(f"not a block name: {stem!r}")
    return BlockId(bytes.fromhex(compat), bytes.fromhex(scope), bytes.fromhex(key))


class ReplicaJournal:
    """The blocks a holder may have advertised (see the module documentation)."""

    def __init__(self, directory: Path, *, fsync: bool = True) -> None:
        self.path = Path(directory) / NAME
        self.fsync = fsync
        self._live: dict[BlockId, ChainPosition | None] | None = None  # loaded on first use
        self._pending: list[str] = []
        self._lines = 0

    # -- reading ----------------------------------------------------------------------------------------------

    @property
    def live(self) -> dict[BlockId, ChainPosition | None]:
        """The blocks whose records may exist at the Index Service, with their chain positions."""
        if self._live is None:
            self._live = self._load()
        return self._live

    def _load(self) -> dict[BlockId, ChainPosition | None]:
        live: dict[BlockId, ChainPosition | None] = {}
        try:
            text = self.path.read_text("ascii", errors="replace")
        except FileNotFoundError:
            return live
        except OSError as exc:
            log.warning("cannot read %s: %s", self.path, exc)
            return live
        for line in text.split("\n")[:-1]:  # a last line without its newline was cut short
            self._lines += 1
            fields = line.split(" ")
            try:
                block = _block(fields[1])
                if fields[0] == "+" and len(fields) in (2, 3):
                    live[block] = ChainPosition.from_text(fields[2]) if len(fields) == 3 else None
                elif fields[0] == "-" and len(fields) == 2:
                    live.pop(block, None)
            except (IndexError, ValueError):
                continue
        return live

    # -- writing ----------------------------------------------------------------------------------------------

    def add(self, block: BlockId, position: ChainPosition | None) -> None:
        self.live[block] = position
        tail = f" {position.to_text()}" if position is not None else ""
        self._pending.append(f"+ {_stem(block)}{tail}\n")

    def remove(self, block: BlockId) -> None:
        if block in self.live:
            del self.live[block]
            self._pending.append(f"- {_stem(block)}\n")

    def sync(self) -> None:
        """Write the buffered lines (and fsync them, when configured); compact the file when it has grown."""
        if not self._pending:
            return
        if self._lines + len(self._pending) > 2 * len(self.live) + 4096:
            self.rewrite()
            return
        lines, self._pending = self._pending, []
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            with open(fd, "a", encoding="ascii") as fh:
                fh.write("".join(lines))
                fh.flush()
                if self.fsync:
                    os.fsync(fh.fileno())
            self._lines += len(lines)
        except OSError as exc:
            log.warning("cannot append to %s: %s", self.path, exc)

    def rewrite(self) -> None:
        """Replace the file with one "+" line per live entry (atomically: a temporary file renamed over it)."""
        self._pending = []
        tmp = self.path.with_name(f".{NAME}.tmp")
        body = "".join(f"+ {_stem(b)}{' ' + p.to_text() if p is not None else ''}\n" for b, p in self.live.items())
        try:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with open(fd, "w", encoding="ascii") as fh:
                fh.write(body)
                fh.flush()
                if self.fsync:
                    os.fsync(fh.fileno())
            os.replace(tmp, self.path)
            self._lines = len(self.live)
        except OSError as exc:
            log.warning("cannot rewrite %s: %s", self.path, exc)


__all__ = ["NAME", "ReplicaJournal"]
