"""Helpers shared by the tests: a manual clock, ``kvsp-quic`` commands run in-process, and a ``kvsp-quic`` server
subcommand run as a real process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvsp_app.cli import main


class Clock:
    """A clock the test moves by hand (``clock.now += 5``); the roles call it for the time in seconds."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``kvsp-quic ARGV`` in this process: its exit code (argparse's usage errors and --help too), stdout, stderr."""
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


class Process:
    """A ``kvsp-quic`` server subcommand (``python -m kvsp_app ARGS``); its one ready line on stdout is parsed into
    :attr:`ready`; :meth:`stop` ends it (SIGTERM, then SIGKILL) and returns what it wrote on stderr."""

    def __init__(self, *args: str) -> None:
        level = [] if "--log-level" in args else ["--log-level", "WARNING"]
        self.proc = subprocess.Popen([sys.executable, "-m", "kvsp_app", *args, *level],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        line = self.proc.stdout.readline()  # exactly one JSON line once it serves
        if not line:
            raise RuntimeError(f"{args[0]} did not start: {self.proc.stderr.read()}")
        self.ready: dict[str, Any] = json.loads(line)

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        assert self.proc.stdout is not None and self.proc.stderr is not None
        rest = self.proc.stdout.read()
        err = self.proc.stderr.read()
        self.proc.stdout.close()
        self.proc.stderr.close()
        assert rest == "", "a server prints exactly one line on stdout"
        return err


def processes_under(root: Path) -> list[int]:
    """The processes whose working directory is *root* or inside it (a ``kvsp-quic demo --workdir root`` starts
    its roles there): unlike a match on command lines, other clusters on the machine do not count."""
    root = root.resolve()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cwd = Path(os.readlink(entry / "cwd"))
            except OSError:  # gone, or not ours to read
                continue
            if cwd == root or root in cwd.parents:
                found.append(int(entry.name))
    return found
