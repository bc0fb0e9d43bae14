"""The front end as OpenAI's clients use it, against real processes: the Index Service with the Placement
Controller, one inference instance (CPU, a tiny random model) and ``kvsp-quic frontend --dev``, all on 127.0.0.1.

The clients are the official ``openai`` SDK (sync and async, whole and streamed, completions and chat) with the
``--dev`` API key and nothing but the CA -- the README's recipe -- and curl with a bearer token."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import ssl
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("torch", reason="the inference instance needs torch: pip install 'kvsp-quic[gpu]'")
openai = pytest.importorskip("openai", reason="pip install 'kvsp-quic[test]'")

CONTEXT = 2048  # the model's max_position_embeddings
INSTANCE_MAX_TOKENS = 1500  # the instance's --max-tokens: more is its refusal (400), not the front end's
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, Any]]:
    from gpu.modelfiles import ModelConfig, write_random_model
    from kvsp_app.demo import Cluster

    root = Path(tempfile.mkdtemp(prefix="kvsp-fe-openai-"))
    write_random_model(root / "model", ModelConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
        vocab_size=300, head_dim=64, max_position_embeddings=CONTEXT, name="tiny-chat"), seed=3)
    (root / "model" / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    procs = Cluster(root, lambda _: None)
    try:
        index = procs.start("index", "index", "--dev", "dev")["base_uri"]
        procs.start("instance", "instance", "--dev", "dev", "--device", "cpu", "--model", "model", "--index", index,
                    "--controller", index, "--max-tokens", str(INSTANCE_MAX_TOKENS))
        instance = procs.procs["instance"].ready["base_uri"]
        fe = procs.start("frontend", "frontend", "--dev", "dev", "--controller", index, "--model", "model")
        yield {"root": root, "ready": fe, "ca": str(root / fe["ca"]), "procs": procs, "index": index,
               "instance": instance}
    finally:
        procs.stop()
        if not os.environ.get("KVSP_KEEP_LOGS"):  # set it to read the processes' logs
            shutil.rmtree(root, ignore_errors=True)


def sdk(cluster: dict[str, Any], *, key: str | None = None) -> Any:
    """The README's recipe: the CA in an ssl context, the base URL and the key from the ready line."""
    ctx = ssl.create_default_context(cafile=cluster["ca"])
    return openai.OpenAI(base_url=cluster["ready"]["openai_base_url"], api_key=key or cluster["ready"]["api_key"],
                         http_client=httpx.Client(verify=ctx), max_retries=0)


def async_sdk(cluster: dict[str, Any]) -> Any:
    ctx = ssl.create_default_context(cafile=cluster["ca"])
    return openai.AsyncOpenAI(base_url=cluster["ready"]["openai_base_url"], api_key=cluster["ready"]["api_key"],
                              http_client=httpx.AsyncClient(verify=ctx), max_retries=0)


def test_ready_line_and_dev_key(cluster: dict[str, Any]) -> None:
    ready, root = cluster["ready"], cluster["root"]
    assert ready["openai_base_url"] == ready["base_uri"] + "v1"
    key_file = root / "dev" / "api.key"
    assert key_file.read_text().strip() == ready["api_key"]
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600


def test_sync_sdk_whole_and_streamed(cluster: dict[str, Any]) -> None:
    with sdk(cluster) as client:
        assert [m.id for m in client.models.list()] == ["tiny-chat"]
        assert client.models.retrieve("tiny-chat").id == "tiny-chat"
        whole = client.completions.create(model="tiny-chat", prompt="Hello, world", max_tokens=12, temperature=0)
        assert whole.choices[0].finish_reason in ("length", "stop") and whole.usage is not None
        assert whole.usage.prompt_tokens == len(b"Hello, world") and whole.usage.completion_tokens <= 12
        chunks = list(client.completions.create(model="tiny-chat", prompt="Hello, world", max_tokens=12, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text  # greedy: the same
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        text = whole.choices[0].text
        at = next((k for k in range(2, len(text) - 2) if "\ufffd" not in text[k:k + 2]), None)
        assert at is not None  # the greedy output of this model has such a place (a stop string from its middle)
        stop = text[at:at + 2]
        cut = client.completions.create(model="tiny-chat", prompt="Hello, world", max_tokens=12, temperature=0,
                                        stop=[stop])
        assert cut.choices[0].text == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"
        parts = list(client.completions.create(model="tiny-chat", prompt="Hello, world", max_tokens=12,
                                               temperature=0, stop=stop, stream=True))
        assert "".join(c.choices[0].text for c in parts) == cut.choices[0].text
        assert parts[-1].choices[0].finish_reason == "stop"
        seeded = [client.completions.create(model="tiny-chat", prompt=[1, 2, 3], max_tokens=6, seed=7).choices[0].text
                  for _ in range(2)]
        assert seeded[0] == seeded[1]  # temperature 1.0 by default, seeded: reproducible


def test_batch_n_and_null_max_tokens(cluster: dict[str, Any]) -> None:
    with sdk(cluster) as client:
        batch = client.completions.create(model="tiny-chat", prompt=["ab", "cd"], max_tokens=4, temperature=0, n=2)
        assert [c.index for c in batch.choices] == [0, 1, 2, 3]
        assert batch.choices[0].text == batch.choices[1].text  # greedy, the same prompt
        assert batch.usage.prompt_tokens == 4
        echo = client.completions.create(model="tiny-chat", prompt="xyz", max_tokens=3, temperature=0, echo=True)
        assert echo.choices[0].text.startswith("xyz")
        with pytest.raises(openai.BadRequestError) as info:  # null: up to the context, then the instance's limit
            client.completions.create(model="tiny-chat", prompt="hi", max_tokens=None)
        assert info.value.status_code == 400 and f"at most {INSTANCE_MAX_TOKENS}" in str(info.value)


async def test_async_sdk_completions_and_chat(cluster: dict[str, Any]) -> None:
    client = async_sdk(cluster)
    async with client:
        many = await asyncio.gather(*(client.completions.create(model="tiny-chat", prompt=f"request {i}",
                                                                max_tokens=5, temperature=0) for i in range(3)))
        assert all(r.usage.completion_tokens <= 5 for r in many)
        chat = await client.chat.completions.create(model="tiny-chat", max_tokens=6, temperature=0,
                                                    messages=[{"role": "system", "content": "Be brief."},
                                                              {"role": "user", "content": "Hi"}])
        assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
        prompt = "<|system|>Be brief.\n<|user|>Hi\n<|assistant|>"
        assert chat.usage.prompt_tokens == len(prompt.encode())
        stream = await client.chat.completions.create(model="tiny-chat", max_tokens=6, temperature=0, stream=True,
                                                      messages=[{"role": "system", "content": "Be brief."},
                                                                {"role": "user", "content": "Hi"}])
        parts = [c async for c in stream]
        assert parts[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in parts) == chat.choices[0].message.content
        assert parts[-1].choices[0].finish_reason == chat.choices[0].finish_reason


def test_errors_in_openai_shape(cluster: dict[str, Any]) -> None:
    with sdk(cluster) as client:
        with pytest.raises(openai.AuthenticationError) as auth, sdk(cluster, key="kvsp-wrong") as wrong:
            wrong.completions.create(model="tiny-chat", prompt="x", max_tokens=1)
        assert auth.value.status_code == 401 and "Incorrect API key" in str(auth.value)
        with pytest.raises(openai.NotFoundError) as missing:
            client.completions.create(model="gpt-4o", prompt="x", max_tokens=1)
        assert missing.value.code == "model_not_found" and "tiny-chat" in str(missing.value)
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("gpt-4o")
        cases: list[tuple[dict[str, Any], str, str]] = [
            ({"prompt": "x", "extra_body": {"top_kk": 5}}, "top_kk", "unrecognized"),
            ({"prompt": "x", "extra_body": {"top_k": -5}}, "top_k", "[-1, 300]"),
            ({"prompt": "x", "stop": [""]}, "stop", "must not be empty"),
            ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
            ({"prompt": "x", "logit_bias": {"300": 5}}, "logit_bias", "not a token id"),
            ({"prompt": "x", "logprobs": 21}, "logprobs", "[0, 20]"),
            ({"prompt": "x", "best_of": 3, "n": 4}, "best_of", "at least n"),
            ({"prompt": [5, 299, 300]}, "prompt", "out of the vocabulary"),
            ({"prompt": "y" * (CONTEXT - 4), "max_tokens": 10}, "max_tokens", f"maximum context length is {CONTEXT}"),
            ({"prompt": "y" * CONTEXT}, "prompt", f"maximum context length is {CONTEXT}"),
        ]
        for kwargs, param, words in cases:
            with pytest.raises(openai.BadRequestError) as bad:
                client.completions.create(model="tiny-chat", max_tokens=kwargs.pop("max_tokens", 2), **kwargs)
            assert bad.value.status_code == 400, (param, bad.value)
            body = bad.value.body
            assert body["param"] == param and words in body["message"], (param, body)
            assert body["kvsp_type"] == "about:blank"


def test_instance_refusal_is_the_callers_400(cluster: dict[str, Any]) -> None:
    """max_tokens within the context and the front end's limit, beyond the instance's: the instance refuses the
    start; the PC answers 400 at once instead of trying every instance and saying 503."""
    with sdk(cluster) as client, pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny-chat", prompt="x", max_tokens=INSTANCE_MAX_TOKENS + 1)
    assert f"at most {INSTANCE_MAX_TOKENS}" in str(bad.value)


def test_plain_http_checks(cluster: dict[str, Any]) -> None:
    ready = cluster["ready"]
    ctx = ssl.create_default_context(cafile=cluster["ca"])
    base = ready["base_uri"]
    auth = {"authorization": f"Bearer {ready['api_key']}"}
    with httpx.Client(verify=ctx) as http:
        assert http.get(base + "health").status_code == 200  # open
        assert http.get(base + "version").json()["version"]
        r = http.post(base + "v1/completions", json={"prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert r.headers["www-authenticate"].startswith("Bearer")
        r = http.post(base + "v1/completions", headers=auth, json={"prompt": "x", "stream": "yes"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
        r = http.post(base + "v1/completions", headers=auth,
                      json={"prompt": "x", "stream_options": {"include_usage": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
        tokens = http.post(base + "tokenize", headers=auth, json={"prompt": "é€"}).json()
        assert tokens == {"count": 5, "max_model_len": CONTEXT, "tokens": list("é€".encode())}
        assert http.post(base + "detokenize", headers=auth, json={"tokens": tokens["tokens"]}).json() == \
            {"prompt": "é€"}
        chat = http.post(base + "tokenize", headers=auth, json={"messages": [{"role": "user", "content": "Hi"}]})
        assert chat.json()["tokens"] == list(b"<|user|>Hi\n<|assistant|>")


def test_client_certificate_still_works(cluster: dict[str, Any]) -> None:
    ready, root = cluster["ready"], cluster["root"]
    ctx = ssl.create_default_context(cafile=cluster["ca"])
    ctx.load_cert_chain(root / ready["client_cert"], root / ready["client_key"])
    with httpx.Client(verify=ctx) as http:
        r = http.post(ready["base_uri"] + "v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def test_curl_with_a_bearer_token(cluster: dict[str, Any]) -> None:
    ready = cluster["ready"]
    run = subprocess.run(["curl", "-sS", "--cacert", cluster["ca"], "-H", f"Authorization: Bearer {ready['api_key']}",
                          "-H", "Content-Type: application/json", "-d",
                          json.dumps({"model": "tiny-chat", "prompt": "Say", "max_tokens": 3, "temperature": 0}),
                          ready["openai_base_url"] + "/completions"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    answer = json.loads(run.stdout)
    assert answer["object"] == "text_completion" and answer["usage"]["prompt_tokens"] == 3
    run = subprocess.run(["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "--cacert", cluster["ca"],
                          ready["openai_base_url"] + "/models"], capture_output=True, text=True, timeout=60)
    assert run.stdout == "401"


async def test_a_client_that_goes_away_cancels_its_session(cluster: dict[str, Any]) -> None:
    """The stream is dropped after a few tokens of a long generation: within a second the PC has forgotten the
    session and the instance has stopped its run (well before max_tokens)."""
    from http3.client import KvspClient
    from quic.tls import TlsFiles

    ready, root = cluster["ready"], cluster["root"]
    port = ready["base_uri"].rstrip("/").rsplit(":", 1)[1]
    as_frontend = TlsFiles(root / ready["ca"], root / "dev" / f"frontend-{port}.pem",
                           root / "dev" / f"frontend-{port}.key")
    ctx = ssl.create_default_context(cafile=cluster["ca"])
    auth = {"authorization": f"Bearer {ready['api_key']}"}
    body = {"prompt": "tell me everything", "max_tokens": INSTANCE_MAX_TOKENS, "temperature": 0, "stream": True}
    async with httpx.AsyncClient(verify=ctx) as http:
        async with http.stream("POST", ready["openai_base_url"] + "/completions", headers=auth, json=body) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()
            first = json.loads((await anext(aiter(lines)))[6:])
        gone_at = asyncio.get_running_loop().time()
    session = first["id"].removeprefix("cmpl-")
    async with KvspClient(as_frontend, retries=0) as kvsp:
        state: dict[str, Any] = {}
        while asyncio.get_running_loop().time() < gone_at + 1.0:
            at_pc = await kvsp.request("GET", f"{cluster['index']}sessions/{session}")
            state = (await kvsp.request("GET", f"{cluster['instance']}sessions/{session}")).json()
            if at_pc.status == 404 and state["state"] != "decode":
                break
            await asyncio.sleep(0.05)
        assert at_pc.status == 404, at_pc.content  # the PC forgot it
        assert state["state"] == "superseded" and state["output_offset"] < INSTANCE_MAX_TOKENS, state


def test_sampler_parameters(cluster: dict[str, Any]) -> None:
    """top_k, logit_bias, the penalties and stop token ids, with outcomes computed by hand from the sampler's rules
    (gpu/sampling.py): a bias of 100 on 'A' (65) and 'B' (66) leaves every other token far behind."""
    with sdk(cluster) as client:
        def text(prompt: str = "xyz", **kwargs: Any) -> str:
            kwargs.setdefault("temperature", 0)
            return str(client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=8, **kwargs)
                       .choices[0].text)

        greedy = text("Hello")
        assert text("Hello", temperature=1.0, seed=11, extra_body={"top_k": 1}) == greedy  # top_k 1: the argmax
        assert text("Hello", temperature=1.0, seed=11, extra_body={"min_p": 1.0}) == greedy  # only the best
        assert text(logit_bias={"65": 100}) == "A" * 8  # forced greedily
        assert text(temperature=1.0, seed=5, logit_bias={"65": 100}) == "A" * 8  # and sampled
        assert text(logit_bias={"65": -100, "66": 100}) == "B" * 8
        both = {"65": 100, "66": 100}
        plain = text(logit_bias=both)
        assert set(plain) <= {"A", "B"}
        # frequency: a token already chosen k times loses 2k, more than the raw logits of A and B differ, so each
        # pair of tokens holds one A and one B
        alternating = text(logit_bias=both, frequency_penalty=2.0)
        assert all(sorted(alternating[i:i + 2]) == ["A", "B"] for i in range(0, 8, 2)), alternating
        # presence: once both are present, both lose 2: the second token is the other one, then as without
        present = text(logit_bias=both, presence_penalty=2.0)
        assert sorted(present[:2]) == ["A", "B"], present
        # repetition: a positive logit of a token seen in the prompt or the output is divided by the penalty
        assert text("xAz", logit_bias=both, extra_body={"repetition_penalty": 1.5})[0] == "B"
        assert text("xBz", logit_bias=both, extra_body={"repetition_penalty": 1.5})[0] == "A"
        repeated = text(logit_bias=both, extra_body={"repetition_penalty": 1.5})
        assert sorted(repeated[:2]) == ["A", "B"], repeated
        # stop token ids (vLLM): the run ends with the first of them, which is part of the output
        whole = client.completions.create(model="tiny-chat", prompt="Hello", max_tokens=8, temperature=0)
        tokens = whole.model_extra["kvsp"]["tokens"]
        stop = tokens[3]
        cut = client.completions.create(model="tiny-chat", prompt="Hello", max_tokens=8, temperature=0,
                                        extra_body={"stop_token_ids": [stop]})
        assert cut.model_extra["kvsp"]["tokens"] == tokens[:tokens.index(stop) + 1]
        assert cut.choices[0].finish_reason == "stop"


def test_logprobs_in_both_shapes(cluster: dict[str, Any]) -> None:
    with sdk(cluster) as client:
        whole = client.completions.create(model="tiny-chat", prompt="Hello", max_tokens=6, temperature=0, logprobs=3)
        lp = whole.choices[0].logprobs
        n = whole.usage.completion_tokens
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
        for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
            assert chosen <= 0 and len(top) <= 3 + 1
            assert chosen == pytest.approx(max(top.values()))  # greedy takes the most likely token
        streamed = list(client.completions.create(model="tiny-chat", prompt="Hello", max_tokens=6, temperature=0,
                                                  logprobs=3, stream=True))
        parts = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs is not None]
        assert [x for p in parts for x in p.token_logprobs] == lp.token_logprobs
        assert [x for p in parts for x in p.text_offset] == lp.text_offset
        chat = client.chat.completions.create(model="tiny-chat", max_tokens=5, temperature=0, logprobs=True,
                                              top_logprobs=2, messages=[{"role": "user", "content": "Hi"}])
        content = chat.choices[0].logprobs.content
        assert len(content) == chat.usage.completion_tokens
        for entry in content:
            assert len(entry.top_logprobs) == 2 and entry.bytes == list(entry.token.encode())
            assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        plain = client.chat.completions.create(model="tiny-chat", max_tokens=2, temperature=0,
                                               messages=[{"role": "user", "content": "Hi"}])
        assert plain.choices[0].logprobs is None
        stream = list(client.chat.completions.create(model="tiny-chat", max_tokens=5, temperature=0, logprobs=True,
                                                     stream=True, messages=[{"role": "user", "content": "Hi"}]))
        entries = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in content])


def test_best_of_answers_the_most_likely_candidates(cluster: dict[str, Any]) -> None:
    with sdk(cluster) as client:
        candidates = client.completions.create(model="tiny-chat", prompt="Once", max_tokens=5, n=3, seed=21,
                                               logprobs=0)
        totals = [sum(c.logprobs.token_logprobs) for c in candidates.choices]
        best = client.completions.create(model="tiny-chat", prompt="Once", max_tokens=5, n=1, best_of=3, seed=21)
        assert len(best.choices) == 1 and best.choices[0].index == 0 and best.choices[0].logprobs is None
        assert best.choices[0].text == candidates.choices[totals.index(max(totals))].text
