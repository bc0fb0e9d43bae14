"""Prompt log probabilities (``echo`` with ``logprobs`` on ``/v1/completions``, vLLM's behaviour) through the official
``openai`` SDK, against real processes: the Index Service with the Placement Controller, one inference instance of
each engine (``reference``, ``transformers``: the module runs once per engine) and ``kvsp-quic frontend --dev``.

The expected values are computed here by transformers on the same model directory (``LlamaForCausalLM``, float32):
each prompt token's log probability is log_softmax of the logits at the position before it; the first token has
none. They must hold for a prompt computed from scratch and for one whose first blocks the instance holds already
(docs/wire.md, "Prompt log probabilities": such a run computes every position), whole and streamed, and for the
"score this text" call (``max_tokens: 0``); and a run resumed from a checkpoint computes them again."""

from __future__ import annotations

import json
import os
import shutil
import ssl
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

torch = pytest.importorskip("torch", reason="the inference instance needs torch: pip install 'kvsp-quic[gpu]'")
transformers = pytest.importorskip("transformers", reason="the test extra (transformers) is not installed")
openai = pytest.importorskip("openai", reason="pip install 'kvsp-quic[test]'")

MODEL = "tiny-lp"
B = 16  # the instance's block size (its default)
TOL = 1e-4
TOP = 3


@pytest.fixture(scope="module", params=["reference", "transformers"])
def cluster(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    from gpu.modelfiles import ModelConfig, write_random_model
    from kvsp_app.demo import Cluster

    engine = request.param
    root = Path(tempfile.mkdtemp(prefix=f"kvsp-fe-prompt-lp-{engine}-"))
    write_random_model(root / "model", ModelConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=300, head_dim=32, max_position_embeddings=512, name=MODEL), seed=5)
    procs = Cluster(root, lambda _: None)
    try:
        index = procs.start("index", "index", "--dev", "dev")["base_uri"]
        inst = procs.start("instance", "instance", "--dev", "dev", "--device", "cpu", "--model", "model",
                           "--engine", engine, "--index", index, "--controller", index, "--warmup-tokens", "8")
        assert inst["engine"] == engine
        fe = procs.start("frontend", "frontend", "--dev", "dev", "--controller", index, "--model", "model")
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(root / "model"), dtype=torch.float32).eval()
        yield {"root": root, "ready": fe, "ca": str(root / fe["ca"]), "instance": inst["base_uri"], "hf": hf,
               "engine": engine, "index": index, "inst": inst}
    finally:
        procs.stop()
        if not os.environ.get("KVSP_KEEP_LOGS"):  # set it to read the processes' logs
            shutil.rmtree(root, ignore_errors=True)


def sdk(cluster: dict[str, Any]) -> Any:
    ctx = ssl.create_default_context(cafile=cluster["ca"])
    return openai.OpenAI(base_url=cluster["ready"]["openai_base_url"], api_key=cluster["ready"]["api_key"],
                         http_client=httpx.Client(verify=ctx), max_retries=0)


def text_of(token: int) -> str:
    """The front end's token text: the model directory's byte-level tokenizer (ids >= 256 are no octet)."""
    return bytes([token]).decode("utf-8", errors="replace") if token < 256 else ""


def expected(cluster: dict[str, Any], tokens: list[int], top_n: int
             ) -> tuple[list[float | None], list[dict[str, float] | None]]:
    """token_logprobs and top_logprobs (*top_n* alternatives) of the prompt *tokens* as vLLM shapes them, from
    transformers' logits."""
    with torch.no_grad():
        logits = cluster["hf"](torch.tensor([tokens])).logits[0]
    lp = torch.log_softmax(logits.to(torch.float64), dim=-1)
    values: list[float | None] = [None]
    tops: list[dict[str, float] | None] = [None]
    for i in range(1, len(tokens)):
        row = lp[i - 1]
        values.append(float(row[tokens[i]]))
        best, index = torch.sort(row, descending=True, stable=True)
        top: dict[str, float] = {}
        for t, v in zip(index[:top_n].tolist(), best[:top_n].tolist(), strict=True):
            top.setdefault(text_of(t), v)  # of tokens with equal texts the likeliest is shown
        top.setdefault(text_of(tokens[i]), float(row[tokens[i]]))  # and always the prompt's own token
        tops.append(top)
    return values, tops


def check_prompt_part(cluster: dict[str, Any], logprobs: Any, tokens: list[int], top_n: int = TOP) -> None:
    """The first len(tokens) entries of a completions logprobs object are the prompt's, exactly."""
    values, tops = expected(cluster, tokens, top_n)
    n = len(tokens)
    assert logprobs.tokens[:n] == [text_of(t) for t in tokens]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for i in range(1, n):
        got, want = logprobs.token_logprobs[i], values[i]
        assert want is not None and abs(got - want) < TOL, (i, got, want)
        got_top, want_top = logprobs.top_logprobs[i], tops[i]
        assert want_top is not None and set(got_top) == set(want_top), (i, got_top, want_top)
        assert all(abs(got_top[k] - want_top[k]) < TOL for k in want_top), (i, got_top, want_top)
    offsets = [0]
    for t in logprobs.tokens[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert logprobs.text_offset == offsets  # vLLM's: one running offset over the prompt and the output


def instance_run(cluster: dict[str, Any], completion_id: str) -> dict[str, Any]:
    """``GET {instance}sessions/{id}`` as the front end (the session's owner) reads it."""
    import asyncio

    from http3.client import KvspClient
    from quic.tls import TlsFiles

    ready, root = cluster["ready"], cluster["root"]
    port = ready["base_uri"].rstrip("/").rsplit(":", 1)[1]
    files = TlsFiles(root / ready["ca"], root / "dev" / f"frontend-{port}.pem", root / "dev" / f"frontend-{port}.key")
    session = uuid.UUID(completion_id.removeprefix("cmpl-"))

    async def get() -> dict[str, Any]:
        async with KvspClient(files, retries=0) as kvsp:
            response = await kvsp.request("GET", f"{cluster['instance']}sessions/{session}")
            assert response.status == 200, response.content
            answer: dict[str, Any] = json.loads(response.content or b"")
            return answer

    return asyncio.run(get())


def test_echo_logprobs_computed_from_scratch(cluster: dict[str, Any]) -> None:
    prompt = f"A fresh prompt for the {cluster['engine']} engine: nothing of it is cached yet."
    tokens = list(prompt.encode())
    with sdk(cluster) as client:
        out = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=TOP, max_tokens=5,
                                        temperature=0)
    choice = out.choices[0]
    assert choice.text.startswith(prompt)
    check_prompt_part(cluster, choice.logprobs, tokens)
    generated = len(choice.logprobs.tokens) - len(tokens)
    assert out.usage.prompt_tokens == len(tokens) and out.usage.completion_tokens == generated
    assert out.usage.total_tokens == len(tokens) + generated and 1 <= generated <= 5
    assert all(v is not None for v in choice.logprobs.token_logprobs[len(tokens):])  # the output's, as before
    assert "".join(choice.logprobs.tokens) == choice.text or "\ufffd" in choice.text
    run = instance_run(cluster, out.id)
    assert run["loaded_blocks"] == 0 and run["computed_tokens"] == len(tokens)
    assert len(run["prompt_logprobs"]) == len(tokens)  # the extension member (docs/wire.md)


def test_echo_logprobs_of_a_prompt_whose_blocks_are_cached(cluster: dict[str, Any]) -> None:
    """The instance holds the first three blocks (an earlier request computed them, and a plain request loads
    them); a request for the prompt's log probabilities still gets every position's, exactly."""
    prefix = f"{cluster['engine']}: a shared system prompt, long enough for three blocks of sixteen."[:3 * B]
    assert len(prefix) == 3 * B
    with sdk(cluster) as client:
        first = client.completions.create(model=MODEL, prompt=prefix + " first tail", max_tokens=2, temperature=0)
        plain = client.completions.create(model=MODEL, prompt=prefix + " second", max_tokens=2, temperature=0)
        assert instance_run(cluster, plain.id)["loaded_blocks"] == 3, "the prefix's blocks are not cached"
        prompt = prefix + " and another tail"
        out = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=TOP, max_tokens=3,
                                        temperature=0)
        again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=TOP)
    assert first.choices[0].text is not None
    tokens = list(prompt.encode())
    check_prompt_part(cluster, out.choices[0].logprobs, tokens)
    run = instance_run(cluster, out.id)
    assert run["loaded_blocks"] == 0 and run["computed_tokens"] == len(tokens)  # every position computed
    # the output is the one a run that loads the blocks samples, with the same log probabilities
    assert out.choices[0].text == prompt + again.choices[0].text
    assert out.choices[0].logprobs.token_logprobs[len(tokens):] == again.choices[0].logprobs.token_logprobs
    assert out.usage.completion_tokens == again.usage.completion_tokens


def test_echo_logprobs_streamed(cluster: dict[str, Any]) -> None:
    prompt = "Streamed: the prompt's chunk comes first, with its log probabilities."
    tokens = list(prompt.encode())
    with sdk(cluster) as client:
        whole = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=4,
                                          temperature=0)
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=4,
                                                temperature=0, stream=True, stream_options={"include_usage": True}))
    parts = [c.choices[0] for c in chunks if c.choices]
    assert parts[0].text == prompt and len(parts[0].logprobs.tokens) == len(tokens)
    assert parts[0].logprobs.token_logprobs[0] is None
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        if part.logprobs is not None:
            for key, values in merged.items():
                values += getattr(part.logprobs, key)
    w = whole.choices[0].logprobs
    assert merged == {"tokens": w.tokens, "token_logprobs": w.token_logprobs, "top_logprobs": w.top_logprobs,
                      "text_offset": w.text_offset}
    assert "".join(p.text for p in parts) == whole.choices[0].text
    assert chunks[-1].usage.prompt_tokens == len(tokens)
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_max_tokens_zero_scores_the_text(cluster: dict[str, Any]) -> None:
    prompts = ["Score this text, please.", "And this one."]
    with sdk(cluster) as client:
        out = client.completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=0,
                                        temperature=0)
        streamed = list(client.completions.create(model=MODEL, prompt=prompts[0], echo=True, logprobs=1,
                                                  max_tokens=0, stream=True))
        bare = client.completions.create(model=MODEL, prompt=prompts[0], echo=True, max_tokens=0)
        with pytest.raises(openai.BadRequestError) as info:  # without echo there is nothing to answer
            client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=0)
    assert info.value.status_code == 400 and "max_tokens" in str(info.value)
    for choice, prompt in zip(out.choices, prompts, strict=True):
        assert choice.text == prompt and choice.finish_reason == "length"
        assert len(choice.logprobs.tokens) == len(prompt.encode())
        check_prompt_part(cluster, choice.logprobs, list(prompt.encode()), top_n=1)
    n = sum(len(p.encode()) for p in prompts)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (n, 0, n)
    assert "".join(c.choices[0].text for c in streamed) == prompts[0]
    assert streamed[-1].choices[0].finish_reason == "length"
    assert bare.choices[0].text == prompts[0] and bare.choices[0].logprobs is None
    assert bare.usage.completion_tokens == 0


def test_a_resumed_run_computes_them_again(cluster: dict[str, Any]) -> None:
    """A resume (as the PC sends it, with the prompt) of a session whose sampler asks for ``prompt_logprobs``
    computes the whole prompt again and has them, exactly; then it replays the checkpoint's output and goes on."""
    import asyncio

    from http3.client import KvspClient
    from kvsp_app.serve import read_scope_key
    from kvsp_quic.keys import BlockKeyer
    from kvsp_quic.records import Sampler, SessionCheckpoint
    from kvsp_quic.roles.controller_records import SessionResume
    from quic.tls import TlsFiles

    root, inst = cluster["root"], cluster["inst"]
    port = cluster["index"].rstrip("/").rsplit(":", 1)[1]
    as_pc = TlsFiles(root / inst["ca"], root / "dev" / f"index-{port}.pem", root / "dev" / f"index-{port}.key")
    prompt = list(f"Resumed on {cluster['engine']}: a prompt of two blocks and a tail.".encode())
    keyer = BlockKeyer(read_scope_key(root / inst["scope_key"]), bytes.fromhex(inst["compat_id"]), B)
    keys = keyer.keys(prompt)
    generated = [65, 66, 67]
    sid = uuid.uuid4()
    sampler = Sampler("greedy", 0, len(generated), True, {"prompt_logprobs": 2})
    checkpoint = SessionCheckpoint(sid, 1, keyer.compat_id, keyer.scope_id, tuple(keys), tuple(prompt[len(keys) * B:]),
                                   tuple(generated), len(generated), sampler)
    resume = SessionResume(2, checkpoint, 5, tuple(prompt))

    async def run() -> dict[str, Any]:
        async with KvspClient(as_pc, retries=0, timeout=30) as kvsp:
            url = f"{cluster['instance']}sessions/{sid}"
            r = await kvsp.request("POST", f"{url}/resume", content=json.dumps(resume.to_json()).encode(),
                                   headers={"content-type": "application/kvsp+json"})
            assert r.status == 200, r.content
            for _ in range(600):
                info: dict[str, Any] = json.loads((await kvsp.request("GET", url)).content or b"")
                if "prompt_logprobs" in info and info["state"] != "prefill":
                    return info
                await asyncio.sleep(0.05)
            raise AssertionError(info)

    info = asyncio.run(run())
    with torch.no_grad():
        lps = torch.log_softmax(cluster["hf"](torch.tensor([prompt])).logits[0].to(torch.float64), dim=-1)
    got = info["prompt_logprobs"]
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        lp, top = got[i]
        assert abs(lp - float(lps[i - 1][prompt[i]])) < TOL, (i, lp)
        best, index = torch.sort(lps[i - 1], descending=True, stable=True)
        assert [t for t, _ in top] == index[:2].tolist(), (i, top)  # by token id, best first
        assert all(abs(v - w) < TOL for (_, v), w in zip(top, best[:2].tolist(), strict=True)), (i, top)
    assert info["loaded_blocks"] == 0 and info["computed_tokens"] == len(prompt)


def test_the_prefill_scores_every_position_and_samples_the_same(tmp_path: Path) -> None:
    """gpu.prefill with ``prompt_logprobs``: the rows of ``all_logits`` as gpu.sampling.position_logprobs shapes them;
    the last token's logits bit for bit those of a prefill without it; no block may be loaded."""
    import asyncio

    from gpu.kvcache import PagedKVCache
    from gpu.model import LlamaModel
    from gpu.modelfiles import ModelConfig, write_random_model
    from gpu.prefill import prefill, prefill_sync, preloaded
    from gpu.sampling import TokenSampler, position_logprobs

    write_random_model(tmp_path / "m", ModelConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=300, head_dim=32, max_position_embeddings=512, name="unit"), seed=9)
    model = LlamaModel.load(tmp_path / "m")
    tokens = [(11 * i + 5) % 300 for i in range(2 * B + 7)]

    def cache() -> PagedKVCache:
        return PagedKVCache.for_descriptor(model.descriptor(B), device=model.device, device_pages=32)

    plain = prefill_sync(model, cache(), tokens)
    rows = prefill_sync(model, cache(), tokens, all_logits=True).logits
    scored = prefill_sync(model, cache(), tokens, prompt_logprobs=4)
    assert torch.equal(scored.logits, plain.logits)  # the sampled tokens do not change
    assert scored.prompt_logprobs is not None and scored.prompt_logprobs[0] is None
    assert scored.prompt_logprobs[1:] == position_logprobs(rows[:-1], tokens[1:], 4)
    assert plain.prompt_logprobs is None
    with pytest.raises(ValueError, match="load no block"):
        asyncio.run(prefill(model, cache(), tokens, [preloaded([])], prompt_logprobs=0))
    for bad in (21, True, -1, "2"):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            TokenSampler("greedy", params={"prompt_logprobs": bad})


def test_position_logprobs_is_a_stable_sort_of_each_row() -> None:
    from gpu.sampling import LOGPROB_FLOOR, position_logprobs

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 40, generator=g)
    logits[1, [3, 7, 20]] = 9.0  # ties: the lower token id first
    logits[2, 5] = -torch.inf
    got = position_logprobs(logits, [3, 7, 5, 0, 39], 4)
    lp = torch.log_softmax(logits.to(torch.float64), dim=1)
    values, index = torch.sort(lp, dim=1, descending=True, stable=True)
    for i, t in enumerate([3, 7, 5, 0, 39]):
        assert got[i][0] == max(float(lp[i, t]), LOGPROB_FLOOR)
        assert got[i][1] == tuple(zip(index[i, :4].tolist(), values[i, :4].tolist(), strict=True))
    assert [t for t, _ in got[1][1][:3]] == [3, 7, 20]
    assert got[2][0] == LOGPROB_FLOOR
