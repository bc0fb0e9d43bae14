"""Helpers shared by the tests: a manual clock, ``kvsp-quic`` commands run in-process, and a ``kvsp-quic`` server
subcommand run as a real process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvsp_app.cli import main
from kvsp_dev.processes import RoleProcess


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


class Process(RoleProcess):
    """A ``kvsp-quic`` server subcommand (``python -m kvsp_app ARGS``, in *cwd*) started at once: its ready line in
    :attr:`ready`, its standard error a pipe; :meth:`stop` ends it (SIGTERM, then SIGKILL), checks that it printed
    nothing more on standard output and returns what it wrote on standard error."""

    def __init__(self, *args: str, cwd: Path | None = None) -> None:
        super().__init__(args[0], *args, stderr="pipe", cwd=cwd)
        self.wait_ready()

    def stop(self, grace: float = 10.0) -> str:
        err = super().stop(grace)
        assert self.stdout_after_ready == "", "a server prints exactly one line on stdout"
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
