"""A seeded session with every sampler parameter (top_k, min_p, the penalties, logit_bias, logprobs) migrates and
continues exactly: instance A runs it and checkpoints to the (fake) PC; instance B resumes a checkpoint from its
middle without the prompt (the repetition penalty's prompt tokens travel in the checkpoint's sampler, the output's
counts are its generated tokens) and produces A's tokens, with their log probabilities. The instance cluster of
tests/support/instance.py."""

from __future__ import annotations

import uuid

import pytest

pytest.importorskip("torch", reason="the gpu extra (torch) is not installed")
pytest.importorskip("safetensors", reason="the gpu extra (safetensors) is not installed")

from gpu.model import LlamaModel
from gpu.sampling import TokenSampler
from tests.support import instance as ia
from tests.support.waits import until

PROMPT, expected_tokens, post, read_stream = ia.PROMPT, ia.expected_tokens, ia.post, ia.read_stream
start_body, tokens_of = ia.start_body, ia.tokens_of

PARAMS = {"p": 0.95, "temperature": 1.2, "top_k": 40, "min_p": 0.01, "presence_penalty": 0.6,
          "frequency_penalty": 0.5, "repetition_penalty": 1.3, "logit_bias": {"9": 3.0, "10": -50}, "logprobs": 2}


async def test_a_penalized_seeded_session_migrates_and_continues_exactly(instance_cluster: ia.Cluster,
                                                                         reference: LlamaModel) -> None:
    cl = instance_cluster
    d = reference.descriptor(4)
    a = await cl.instance()
    b = await cl.instance()
    a_uri, b_uri = a.role.settings.base_uri, b.role.settings.base_uri
    sid = uuid.uuid4()
    sampler = {"method": "top-p", "params": PARAMS, "seed": 7, "step": 0, "deterministic": False}
    r = await post(cl.alice, f"{a_uri}sessions/{sid}/start", start_body(sid, PROMPT, max_tokens=16, d=d,
                                                                       sampler=sampler))
    assert r.status == 201, r.content
    lines = await read_stream(cl.alice, f"{a_uri}sessions/{sid}/tokens")
    tokens = tokens_of(lines)
    with_prompt = {**PARAMS, "prompt_tokens": sorted(set(PROMPT))}
    assert tokens == await expected_tokens(reference, PROMPT, 16, TokenSampler("top-p", params=with_prompt, seed=7))
    assert 10 not in tokens  # biased away
    for x in lines[:-1]:
        assert x["logprob"] <= 0 and len(x["top_logprobs"]) == 2
        assert x["top_logprobs"][0][1] >= x["top_logprobs"][1][1]
    await until(lambda: a.role.sessions.get(sid).checkpoints_settled)
    cps = [x for x in cl.pc.checkpoints if x["session"] == str(sid)]
    assert all(x["sampler"]["params"] == with_prompt for x in cps)  # the prompt's tokens travel with the state
    offset = 9
    cp = next(x for x in cps if x["output_offset"] >= offset)
    cp = dict(cp, generated=cp["generated"][:offset], output_offset=offset, sampler=dict(cp["sampler"], step=offset))
    r = await post(cl.alice, f"{b_uri}sessions/{sid}/resume", {"epoch": 2, "checkpoint": cp, "max_tokens": 16})
    assert r.status == 200, r.content
    resumed = await read_stream(cl.alice, f"{b_uri}sessions/{sid}/tokens?from=0")
    assert tokens_of(resumed) == tokens  # the checkpoint's tokens, then the continuation: identical
    assert all("logprob" not in x for x in resumed[:offset])  # taken from the checkpoint: none
    assert [x["logprob"] for x in resumed[offset:-1]] == [x["logprob"] for x in lines[offset:-1]]
    assert b.role.sessions.get(sid).loaded_blocks >= 6  # the prompt's blocks: B never saw the prompt
