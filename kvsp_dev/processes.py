"""``kvsp-quic`` roles run as real processes (``python -m kvsp_app ARGS``), as the demo, the chaos suite, the interop
matrix, the tests and the benchmarks start them: :class:`RoleProcess` starts one, reads the one JSON line a server
prints on standard output once it serves (its ready line), and stops it; :func:`stop_all` stops several at once.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Literal

READY_TIMEOUT = 120.0  # seconds a role may take to print its ready line (an instance loads and warms up a model)
GRACE = 15.0  # seconds between SIGTERM and SIGKILL
_QUIET = 1.0  # a pipe of an ended process read until end of file, or until it is silent this long...
_DRAIN = 5.0  # ...or this long in all (a child the role left running may hold the pipe open)


class RoleDidNotStart(RuntimeError):
    """A role process that ended, or printed no JSON ready line in time; it is killed. The message names the role,
    why, and the last line of its log or standard error (:attr:`output`: all of it, when a pipe)."""

    def __init__(self, name: str, why: str, last_line: str, log: Path | None, output: str = "") -> None:
        where = f" (log: {log})" if log is not None else ""
        super().__init__(f"{name} did not start ({why}): {last_line}{where}")
        self.name = name
        self.last_line = last_line
        self.log = log
        self.output = output


class RoleProcess:
    """``python -m kvsp_app ARGS`` started now, named *name*, with ``--log-level LOG_LEVEL`` appended unless *args*
    set one. Standard output is a pipe (:meth:`wait_ready` reads the ready line there). Standard error goes to
    *stderr*: a log file (written, or appended to with *append*), ``"pipe"`` (read at :meth:`stop`, which returns
    it), or ``"inherit"`` (this process's). *cwd* and *env* are the child's working directory and environment;
    *launcher* is a command the role runs under, which must exec it (``("ip", "netns", "exec", NS)``: in a network
    namespace).

    :attr:`args` are *args* as given: ``RoleProcess(p.name, *p.args)`` starts it again."""

    def __init__(self, name: str, *args: str, stderr: Path | Literal["pipe", "inherit"] = "inherit",
                 append: bool = False, log_level: str = "WARNING", cwd: Path | None = None,
                 env: Mapping[str, str] | None = None, launcher: Sequence[str] = ()) -> None:
        self.name = name
        self.args = args
        self.log = stderr if isinstance(stderr, Path) else None
        self.ready: dict[str, Any] = {}
        self.stdout_after_ready = ""  # what it printed on standard output after its ready line (known once stopped)
        self._after_ready = b""
        self._stderr_text: str | None = None  # what stop() returns, once the pipes are closed
        self._terminated = False
        level = () if "--log-level" in args else ("--log-level", log_level)
        cmd = [*launcher, sys.executable, "-m", "kvsp_app", *args, *level]
        if self.log is not None:
            with self.log.open("a" if append else "w") as err:
                self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=cwd, env=env)
        else:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=cwd, env=env,
                                         stderr=subprocess.PIPE if stderr == "pipe" else None)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def base(self) -> str:
        """The base URI of its ready line."""
        return str(self.ready["base_uri"])

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> dict[str, Any]:
        """Its ready line (one JSON object on one line), within *timeout* seconds; kept as :attr:`ready`. Raises
        :class:`RoleDidNotStart` (the process killed, its pipes closed) when it ends first, prints something else,
        or is silent that long."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        buffer = b""
        while b"\n" not in buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._did_not_start(f"no ready line within {timeout:g} s")
            if not select.select([fd], [], [], left)[0]:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                try:
                    code = self.proc.wait(_DRAIN)
                except subprocess.TimeoutExpired:
                    raise self._did_not_start("closed its standard output") from None
                raise self._did_not_start(f"exited with status {code}")
            buffer += chunk
        line, _, self._after_ready = buffer.partition(b"\n")
        try:
            ready = json.loads(line)
        except ValueError:
            ready = None
        if not isinstance(ready, dict):
            raise self._did_not_start(f"printed {line[:200].decode(errors='replace')!r}, not a JSON ready line")
        self.ready = ready
        return ready

    def freeze(self) -> None:
        """SIGSTOP: it no longer runs, its sockets stay open (a peer that went silent)."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT, after :meth:`freeze`."""
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL (no graceful close: a crash), and wait for it. Its pipes stay open for :meth:`stop`."""
        self.proc.kill()
        self.proc.wait()

    def terminate(self) -> None:
        """Ask it to stop: SIGCONT (a frozen process must run to hear it), then SIGTERM, once; no wait."""
        if self.proc.poll() is None and not self._terminated:
            self._terminated = True
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, grace: float = GRACE) -> str:
        """End it -- :meth:`terminate`, SIGKILL after *grace* seconds -- and close its pipes; returns what it wrote
        on standard error when that is a pipe ("" otherwise). Again, once stopped: the same text."""
        return self._end(grace)

    def _end(self, grace: float) -> str:
        if self._stderr_text is not None:
            return self._stderr_text
        self.terminate()
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.kill()
        self.stdout_after_ready = (self._after_ready + _drain(self.proc.stdout)).decode(errors="replace")
        self._stderr_text = _drain(self.proc.stderr).decode(errors="replace")
        return self._stderr_text

    def _did_not_start(self, why: str) -> RoleDidNotStart:
        if self.proc.poll() is None:
            self.kill()
        output = self._end(0)
        text = output
        if self.log is not None:
            with self.log.open("rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
                text = f.read().decode(errors="replace")
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if lines:
            last = lines[-1]
        elif self.log is None and self.proc.stderr is None:
            last = "its log is on this process's stderr"
        else:
            last = "no output"
        return RoleDidNotStart(self.name, why, last, self.log, output)


def stop_all(processes: Iterable[RoleProcess], grace: float = GRACE) -> list[str]:
    """Stop *processes*: SIGTERM to all of them first, then each as :meth:`RoleProcess.stop` (SIGKILL after *grace*
    seconds each); what each wrote on standard error (when a pipe), in their order."""
    started = list(processes)
    for process in started:
        process.terminate()
    return [process.stop(grace) for process in started]


def _drain(stream: IO[str] | None) -> bytes:
    """What is left in the pipe *stream* of an ended process (until end of file; see _QUIET, _DRAIN); closes it."""
    if stream is None or stream.closed:
        return b""
    fd = stream.fileno()
    deadline = time.monotonic() + _DRAIN
    chunks = []
    while (left := deadline - time.monotonic()) > 0 and select.select([fd], [], [], min(_QUIET, left))[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    stream.close()
    return b"".join(chunks)
