"""A ``kvsp-quic`` server subcommand started by a benchmark, its one ready line, and how it ends.

(The tests have their own, tests/helpers.py ``Process``; benchmarks do not import tests.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any


class Proc:
    """``python -m kvsp_app ARGS`` named *name*; :meth:`wait_ready` reads its ready line. Its log (WARNING and
    above) goes to this process's stderr, or with *log* its INFO log to that file."""

    def __init__(self, name: str, *args: str, log: Path | None = None) -> None:
        self.name = name
        self.log = log
        cmd = [sys.executable, "-m", "kvsp_app", *args, "--log-level", "WARNING" if log is None else "INFO"]
        if log is None:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        else:
            with log.open("w") as err:
                self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        self.ready: dict[str, Any] = {}

    def wait_ready(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} did not start")
        self.ready = json.loads(line)
        return self.ready

    @property
    def base(self) -> str:
        return str(self.ready["base_uri"])

    def kill(self) -> None:
        """SIGKILL, and wait for it."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        """SIGTERM (a graceful stop), SIGKILL after 20 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
