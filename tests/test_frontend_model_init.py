"""``kvsp-quic model init`` writes a chat template (tokenizer_config.json), so /v1/chat/completions works on a freshly
initialised model: the model, an index with the PC, an instance and the front end as real processes, the official
``openai`` SDK as the client."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from kvsp_app.cli_model import CHAT_TEMPLATE
from kvsp_frontend.text import load_chat_template

ROOT = Path(__file__).resolve().parent.parent


def init(directory: Path, *extra: str) -> None:
    run = subprocess.run([sys.executable, "-m", "kvsp_app", "model", "init", str(directory), "--layers", "1",
                          "--kv-heads", "1", "--head-dim", "16", "--max-positions", "512", *extra],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr


def test_init_writes_a_chat_template_and_can_leave_it_out(tmp_path: Path) -> None:
    init(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    assert config == {"chat_template": CHAT_TEMPLATE}
    render = load_chat_template(tmp_path / "m")
    assert render is not None
    assert render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]) == \
        "<|system|>Be brief.\n<|user|>Hi\n<|assistant|>"
    init(tmp_path / "bare", "--no-chat-template")
    assert not (tmp_path / "bare" / "tokenizer_config.json").exists()
    assert load_chat_template(tmp_path / "bare") is None


def test_chat_on_a_freshly_initialised_model() -> None:
    pytest.importorskip("torch", reason="the inference instance needs torch: pip install 'kvsp-quic[gpu]'")
    openai = pytest.importorskip("openai", reason="pip install 'kvsp-quic[test]'")
    from kvsp_app.demo import Cluster

    root = Path(tempfile.mkdtemp(prefix="kvsp-fe-init-"))
    init(root / "model")
    procs = Cluster(root, lambda _: None)
    try:
        index = procs.start("index", "index", "--dev", "dev")["base_uri"]
        procs.start("instance", "instance", "--dev", "dev", "--device", "cpu", "--model", "model", "--index", index,
                    "--controller", index)
        fe = procs.start("frontend", "frontend", "--dev", "dev", "--controller", index, "--model", "model")
        ctx = ssl.create_default_context(cafile=str(root / fe["ca"]))
        with openai.OpenAI(base_url=fe["openai_base_url"], api_key=fe["api_key"],
                           http_client=httpx.Client(verify=ctx), max_retries=0) as client:
            chat = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=4,
                                                  temperature=0, messages=[{"role": "user", "content": "Hi"}])
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 4
        assert chat.usage.prompt_tokens == len(b"<|user|>Hi\n<|assistant|>")
    finally:
        procs.stop()
        shutil.rmtree(root, ignore_errors=True)
