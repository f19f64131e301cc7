#!/usr/bin/env bash
# The shipped feature heads of the Qwen2.5-Coder models, reproduced: code requests and source text from
# this machine's Python standard library (scripts/code_corpus.py), the model's own greedy answers in
# its default dtype, then `selfspec calibrate --head feature`. Prints α by draft position on the held-out
# tenth of the requests and writes the head into WORK (and points this machine's profile at it).
#
#   bash scripts/code_heads.sh qwen2.5-coder-0.5b [WORK] [extra calibrate options, e.g. --device cuda]
#   bash scripts/code_heads.sh qwen2.5-coder-1.5b
#
# Time on 2 CPU cores (AMD EPYC, 2 threads): 0.5B about 25 minutes, 1.5B about 50 minutes; decoding the
# answers is most of it. Copy WORK/MODEL/*.feature.safetensors to selfspec/data/heads/ to ship a head.
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:?usage: code_heads.sh MODEL [WORK] [calibrate options]}"
shift
work=heads-work
if [ $# -ge 1 ] && [ "${1#-}" = "$1" ]; then work="$1"; shift; fi  # WORK given (not an option)
case "$model" in
  qwen2.5-coder-0.5b) settings=(--num-prompts 160 -n 128 --steps 1500); chars=300000 ;;
  qwen2.5-coder-1.5b) settings=(--num-prompts 120 -n 128 --steps 1200 --width 768); chars=100000 ;;
  *) echo "code_heads.sh: no settings for $model (qwen2.5-coder-0.5b or qwen2.5-coder-1.5b)" >&2; exit 2 ;;
esac
py=.venv/bin/python
[ -x "$py" ] || py=python3
mkdir -p "$work/$model"
"$py" scripts/code_corpus.py --prompts "$work/code_prompts.jsonl" --text "$work/$model/stdlib.txt" --max-chars "$chars"
"$py" -m selfspec.cli calibrate --head feature -m "$model" --prompts "$work/code_prompts.jsonl" \
  --text "$work/$model/stdlib.txt" "${settings[@]}" --data "$work/$model/data.pt" --output "$work/$model" "$@"
