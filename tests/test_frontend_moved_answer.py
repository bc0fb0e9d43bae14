"""The tokens the front end read before a suspect report's ``moved`` answer reach the client (issue 26).

The front end reads an instance's token stream through a queue: each token is offered to the session's
:class:`~kvsp_quic.frontend.TokenRelay` (which then counts it delivered) as it is read, and handed to the client as
it is taken out of the queue. A stall report (``POST sessions/{id}/suspect``) answered ``moved`` -- the session has
a new epoch, or it is done at the PC -- made the front end leave that stream at once, and the tokens still in the
queue were dropped: the next read starts at the relay's next index, after them. Under CPU load a stall report is
answered ``moved`` (done) when the instance had finished the session while the front end was still relaying its
last tokens: ``kvsp-quic chaos`` saw reference runs with tokens missing, in the middle or at the end of a stream
("2 tokens altered in the fault-free row", "103 in relay-kill": the reference's tokens compared by position).

Here with real processes on 127.0.0.1 (one ``kvsp-quic index``, one CPU instance): a stall report is made as soon
as the queue is empty once tokens flow (a stall bound of 0), the PC is asked only once the session is done there
(so it answers ``moved``), and the client takes no token meanwhile (so the instance's last tokens wait in the queue).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from http3.client import KvspClient
from kvsp_client.api import KvspApi
from kvsp_frontend.session import Completion, Frontend, StallWatch
from kvsp_quic.frontend import SamplingRequest
from kvsp_quic.roles.controller_records import SessionState, SuspectAnswer, Verdict
from tests.helpers import Process
from tests.support.instance_processes import Bytes, active, files_of, keyer_of, start_instances, tiny_model
from tests.support.waits import until

pytest.importorskip("torch", reason="the gpu extra (torch) is not installed")

PROMPT = [5, 17, 3, 99, 42, 7, 1, 250, 8, 64, 33, 21]
MAX_TOKENS = 120


async def done_at_pc(api: KvspApi, pc: str, session: uuid.UUID) -> None:
    """Until the PC holds *session* done (its instance's last checkpoint acknowledged)."""

    async def done() -> bool:
        return (await api.session_info(pc, session)).state is SessionState.DONE

    await until(done, 60.0, "the session, done at the PC")


@dataclass
class ReportWhenDone(Completion):
    """A completion whose stall reports reach the PC only once the session is done there (the answer is then
    ``moved``); *answered* is set when the answer is in, *reported_after* is how many tokens the client had."""

    api: KvspApi | None = None
    pc: str = ""
    delivered: int = 0
    reported_after: int | None = None
    answered: asyncio.Event = field(default_factory=asyncio.Event)
    answers: list[SuspectAnswer | None] = field(default_factory=list)

    async def _report(self, reason: str) -> SuspectAnswer | None:
        if self.reported_after is None:
            self.reported_after = self.delivered
        assert self.api is not None
        await done_at_pc(self.api, self.pc, self.session)
        answer = await super()._report(reason)
        self.answers.append(answer)
        self.answered.set()
        return answer


async def test_tokens_read_before_a_moved_answer_are_delivered(tmp_path: Path, procs: list[Process]) -> None:
    model = tiny_model(tmp_path)
    dev = str(tmp_path / "dev")
    pc = Process("index", "--dev", dev)
    procs.append(pc)
    uri = pc.ready["base_uri"]
    instances = await start_instances(1, dev, model, [uri], procs)
    async with KvspClient(files_of(pc.ready), timeout=10) as client:
        await active(client, uri, instances)
        frontend = Frontend(client, uri, keyer_of(instances[0]), Bytes(), "tiny", vocab_size=256)
        greedy = SamplingRequest.from_openai(0.0, None, 7, 7)
        reference = [t async for _, t, _ in Completion(frontend, list(PROMPT), MAX_TOKENS, greedy).tokens()]
        assert len(reference) == MAX_TOKENS

        run = ReportWhenDone(frontend, list(PROMPT), MAX_TOKENS, greedy, api=KvspApi(client), pc=uri,
                             watch=StallWatch(floor_s=0.0, factor=0.0, min_gaps=2))
        got: dict[int, int] = {}
        async for index, token, _ in run.tokens():
            assert index not in got, f"index {index} delivered twice"
            got[index] = token
            run.delivered = len(got)
            if run.reported_after is not None and not run.answered.is_set():
                await asyncio.wait_for(run.answered.wait(), 60)  # the instance's last tokens wait in the queue
        assert run.reported_after is not None and run.reported_after < MAX_TOKENS - 2, \
            f"the stall report came after {run.reported_after} tokens: nothing was left to lose"
        assert run.answers and run.answers[0] is not None and run.answers[0].verdict is Verdict.MOVED
        assert sorted(got) == list(range(MAX_TOKENS)), \
            f"{MAX_TOKENS - len(got)} tokens missing, first {min(set(range(MAX_TOKENS)) - set(got), default=None)}"
        assert [got[i] for i in range(MAX_TOKENS)] == reference
