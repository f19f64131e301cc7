"""The CUDA path, checked and timed on a GPU (run where one is lent; nothing here runs in CI).

    python scripts/gpu_check.py smoke            # tiny models of every architecture: greedy identity
                                                 # with CUDA graphs, eager and compiled, bfloat16
    python scripts/gpu_check.py costs [--model M] [--random]
                                                 # one step, c(k), v(k, n) per mode (eager, graphs,
                                                 # compiled + graphs); --random: SmolLM2's shapes,
                                                 # random weights (timings only)
    python scripts/gpu_check.py profile [--model M] [--method feature]
                                                 # where one generation's time goes, per phase and
                                                 # per op (torch.profiler): the feature head's draft
                                                 # cost on CUDA (c 12-18 on an H200) is unexplained

Modes: "eager" is exact mode with SELFSPEC_CUDA_GRAPHS=0 (PyTorch ops launched one by one);
"graphs" captures each decode forward as a CUDA graph (selfspec.model.cuda_graphs); "compiled" adds
torch.compile's fused kernels inside those graphs; "default" is --no-exact, uncompiled.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

MODES = {"eager": dict(exact=True, compile=False, graphs=False), "graphs": dict(exact=True, compile=False, graphs=True),
         "compiled": dict(exact=True, compile=True, graphs=True), "default": dict(exact=False, compile=False, graphs=False)}


def _model(hf, mode: str, tokenizer=None, name="model"):
    from selfspec.api import SelfSpecModel

    m = MODES[mode]
    os.environ["SELFSPEC_CUDA_GRAPHS"] = "1" if m["graphs"] else "0"
    return SelfSpecModel(hf, tokenizer, name, compile=m["compile"], exact=m["exact"], dtype_name="bfloat16")


def smoke(device: str) -> dict:
    """Greedy identity of every method against AR, per architecture and mode, on tiny models."""
    from lossless import REPETITIVE
    from tiny_models import ARCHS, tiny_model

    methods = [dict(method="early-exit", exit_layer=2, draft_len=3), dict(method="layer-skip", skip="attn:1,3 mlp:2,4",
               draft_len=3), dict(method="lookup", draft_len=3), dict(method="swift", draft_len=3)]
    results = {}
    for arch in ARCHS:
        for mode in ("graphs", "eager", "compiled") if arch in ("llama", "gemma3_text") else ("graphs", "eager"):
            key = f"{arch}/{mode}"
            t0 = time.perf_counter()
            try:
                model = _model(tiny_model(arch, dtype=torch.bfloat16).to(device), mode)
                ar = model.generate(REPETITIVE, method="ar", max_new_tokens=24).tokens
                same = {o["method"]: model.generate(REPETITIVE, max_new_tokens=24, **o).tokens == ar for o in methods}
                graphs = model.adapter.step.graphs
                results[key] = dict(identical=same, captures=graphs and graphs.captures, replays=graphs and graphs.replays,
                                    seconds=round(time.perf_counter() - t0, 1))
            except Exception as e:  # noqa: BLE001 - report and go on: one call on a lent GPU must say everything
                results[key] = dict(error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-1500:])
            print(key, json.dumps(results[key])[:400], flush=True)
    return results


def _smollm2_random(device):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    return hf.to(device).eval().requires_grad_(False)


def costs(device: str, model_name: str | None, random: bool, modes: list[str]) -> dict:
    from selfspec.model.loading import load_hf
    from selfspec.tools.tune.costs import measure_costs

    out = {}
    if random:
        hf, tokenizer, name = _smollm2_random(device), None, "SmolLM2-135M shapes, random weights"
    else:
        loaded = load_hf(model_name, dtype=torch.bfloat16, device=device, progress=False)
        hf, tokenizer, name = loaded.model, loaded.tokenizer, loaded.name
    for mode in modes:
        t0 = time.perf_counter()
        try:
            model = _model(hf, mode, tokenizer, name)
            L = model.n_layers
            with torch.inference_mode():
                c = measure_costs(model.adapter, context=256, exit_layers=[L // 4, L // 2, (3 * L) // 4], max_draft_len=3,
                                  draft_layers=[1, L // 4, L // 2, (3 * L) // 4, L], repeats=5, progress=False)
            out[mode] = dict(c.to_json(), step_ms=round(c.step_s * 1e3, 3), setup_s=round(time.perf_counter() - t0, 1))
        except Exception as e:  # noqa: BLE001
            out[mode] = dict(error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-1500:])
        print(name, mode, json.dumps(out[mode]), flush=True)
    return {"model": name, "modes": out}


def profile(device: str, model_name: str | None, method: str, modes: list[str]) -> dict:
    """One warmed-up generation per mode under torch.profiler: the phases' seconds (stats) and the
    ops that took the most host and device time, with the host-device syncs counted."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from selfspec.model.loading import load_hf

    loaded = load_hf(model_name, dtype=torch.bfloat16, device=device, progress=False)
    prompt = "Explain the difference between a list and a tuple in Python, with examples."
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    out = {}
    for mode in modes:
        model = _model(loaded.model, mode, loaded.tokenizer, loaded.name)
        model.generate(prompt, method=method, max_new_tokens=16)  # captures, compiles, first begin
        with torch_profile(activities=activities) as prof:
            result = model.generate(prompt, method=method, max_new_tokens=48)
        stats = result.stats.to_dict()
        key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=15)
        host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
        syncs = {e.key: e.count for e in prof.key_averages()
                 if any(s in e.key for s in ("Synchronize", "Memcpy", "item", "_local_scalar_dense"))}
        out[mode] = dict(stats={k: v for k, v in stats.items() if k.endswith("_s") or k in ("alpha", "cost", "rounds")},
                         syncs=syncs)
        print(f"== {loaded.name} {method} {mode}: {result.stats.summary()}\n{json.dumps(out[mode])}\n"
              f"-- by device time\n{table}\n-- by host time\n{host}", flush=True)
    return {"model": loaded.name, "method": method, "modes": out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["smoke", "costs", "profile"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default=None)
    p.add_argument("--random", action="store_true")
    p.add_argument("--method", default="feature", help="profile: the method to profile (default feature)")
    p.add_argument("--modes", default="eager,graphs,compiled,default")
    p.add_argument("--json", default=None, help="write the results here too")
    a = p.parse_args()
    if a.device == "cuda":
        print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    if a.what == "smoke":
        result = smoke(a.device)
    elif a.what == "costs":
        result = costs(a.device, a.model, a.random, a.modes.split(","))
    else:
        result = profile(a.device, a.model, a.method, a.modes.split(","))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
