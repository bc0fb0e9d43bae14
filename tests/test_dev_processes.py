"""kvsp_dev.processes: a role process's ready line, why one did not start, and its stop."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from kvsp_dev.processes import RoleDidNotStart, RoleProcess, stop_all


@pytest.mark.parametrize("to_file", [False, True])
def test_a_role_that_exits_names_itself_and_the_last_line_it_wrote(tmp_path: Path, to_file: bool) -> None:
    log = tmp_path / "bad.log"
    process = RoleProcess("bad", "index", "--no-such-option", stderr=log if to_file else "pipe")
    with pytest.raises(RoleDidNotStart) as info:
        process.wait_ready(60)
    message = str(info.value)
    assert message.startswith("bad did not start (exited with status 2): ")
    assert message.endswith("unrecognized arguments: --no-such-option" + (f" (log: {log})" if to_file else ""))
    assert ("usage: kvsp-quic" in info.value.output) is not to_file
    assert process.proc.stdout is not None and process.proc.stdout.closed


def test_a_frozen_role_is_stopped_and_its_pipes_closed(tmp_path: Path) -> None:
    process = RoleProcess("index", "index", "--dev", str(tmp_path / "dev"), stderr="pipe")
    ready = process.wait_ready(60)
    assert ready["ready"] == "index" and process.base == ready["base_uri"]
    process.freeze()  # SIGSTOP: stop_all wakes it for its SIGTERM
    [err] = stop_all([process], grace=30)
    assert process.proc.returncode is not None and process.proc.returncode != -signal.SIGKILL
    assert process.stdout_after_ready == "" and "Traceback" not in err
    assert process.proc.stderr is not None and process.proc.stderr.closed
    assert process.stop() == err  # once stopped: the same text
