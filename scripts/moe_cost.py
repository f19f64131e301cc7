"""c for expert-subset drafts: time of a one-token draft forward with each MoE layer routed to
`budget` experts, over the full model's one-token forward (warm medians), on a random-weight MoE
of a real model's shape.

Real MoE checkpoints do not fit this machine's memory in float32, so the model keeps the real
layer shape (hidden size, heads, experts, top-k, expert and shared-expert sizes, vocabulary) but
only as many layers as fit in --max-gib. Every layer of these shapes is a MoE layer, so the
per-layer time scales with depth while the head's does not: besides c at the built depth the
script prints c extrapolated to the real depth from the separately timed layers and head.

    python scripts/moe_cost.py --shape olmoe-1b-7b               # OLMoE shape as Qwen3-MoE layers
    python scripts/moe_cost.py --shape qwen1.5-moe-a2.7b --experts 1 2 4
    python scripts/moe_cost.py --shape tiny --repeats 3          # a seconds-long check that it runs
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from selfspec.adapter import ModelAdapter
from selfspec.moe import experts_per_token

# name -> (config class, real depth, config fields). OLMoE's own attention (q/k norm over the whole
# projection) is not supported by the adapter; its shape runs as Qwen3-MoE layers (per-head q/k
# norm, same projections, same un-renormalised top-8 of 64 routing).
SHAPES = {
    "olmoe-1b-7b": (Qwen3MoeConfig, 16, dict(
        hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, head_dim=128, vocab_size=50304,
        num_experts=64, num_experts_per_tok=8, moe_intermediate_size=1024, intermediate_size=1024,
        norm_topk_prob=False)),
    "qwen1.5-moe-a2.7b": (Qwen2MoeConfig, 24, dict(
        hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, vocab_size=151936,
        num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
        intermediate_size=5632, norm_topk_prob=False)),
    "mixtral-8x7b": (MixtralConfig, 32, dict(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=14336)),
    "tiny": (MixtralConfig, 4, dict(  # for checking the script, not for figures
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=512)),
}


def build(shape: str, layers: int | None, max_gib: float, dtype: torch.dtype):
    """The random model and its real depth; layers=None: as many as fit in max_gib."""
    cls, depth, fields = SHAPES[shape]
    config = lambda n: cls(**fields, num_hidden_layers=n, max_position_embeddings=4096, tie_word_embeddings=False)  # noqa: E731
    if layers is None:
        with torch.device("meta"):
            probe = AutoModelForCausalLM.from_config(config(1))
        per_layer = sum(p.numel() for p in probe.model.layers[0].parameters()) * dtype.itemsize
        rest = sum(p.numel() for p in probe.parameters()) * dtype.itemsize - per_layer
        layers = max(1, min(depth, int((max_gib * 2**30 - rest) // per_layer)))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(layers), attn_implementation="sdpa", dtype=dtype)
    return model.eval().requires_grad_(False), depth


def median_ms(samples: list[float]) -> float:
    return 1000 * statistics.median(samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="olmoe-1b-7b", choices=list(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="layers to build (default: as many as fit --max-gib)")
    p.add_argument("--max-gib", type=float, default=6.0, help="weights budget when --layers is not given (default 6)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--experts", type=int, nargs="+", default=[1, 2], help="draft budgets to time (default 1 2)")
    p.add_argument("--context", type=int, default=128, help="positions in the cache before the timed token (default 128)")
    p.add_argument("--repeats", type=int, default=15, help="timed forwards per variant, after 2 warm-ups (default 15)")
    args = p.parse_args()

    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    model, depth = build(args.shape, args.layers, args.max_gib, dtype)
    adapter = ModelAdapter(model)
    n, top_k = adapter.n_layers, experts_per_token(adapter.layers)
    gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    print(f"{args.shape}: {n} of {depth} layers built ({gib:.1f} GiB {args.dtype}, {time.perf_counter() - t0:.0f} s), "
          f"top-{top_k} routing, {torch.get_num_threads()} threads, context {args.context}")
    budgets = [b for b in args.experts if 1 <= b < top_k]
    variants = [None, *budgets]  # None: the full model's routing

    cache = adapter.new_cache(args.context + 1)
    gen = torch.Generator().manual_seed(0)
    vocab = adapter.embed_tokens.num_embeddings
    token = torch.randint(0, vocab, (1,), generator=gen)
    layer_s = {v: [] for v in variants}
    forward_s = {v: [] for v in variants}
    head_s = []
    with torch.inference_mode():
        prompt = torch.randint(0, vocab, (args.context,), generator=gen)
        adapter.run_layers(adapter.embed(prompt), range(n), 0, cache)
        for r in range(args.repeats + 2):  # variants interleaved, so machine noise spreads over all of them
            for v in variants:
                t = time.perf_counter()
                h = adapter.run_layers(adapter.embed(token), range(n), args.context, cache, experts=v)
                t_layers = time.perf_counter()
                adapter.head(h)
                t_end = time.perf_counter()
                if r >= 2:
                    layer_s[v].append(t_layers - t)
                    forward_s[v].append(t_end - t)
                    head_s.append(t_end - t_layers)

    full, head = median_ms(forward_s[None]), median_ms(head_s)
    full_layers = median_ms(layer_s[None])
    print(f"full forward {full:.2f} ms (embed and layers {full_layers:.2f}, head {head:.2f}); medians of {args.repeats}")
    print(f"{'budget':>8} {'draft ms':>9} {'c':>6} {'c at ' + str(depth) + ' layers':>16}")
    for b in budgets:
        draft, draft_layers = median_ms(forward_s[b]), median_ms(layer_s[b])
        scale = depth / n  # layer time grows with depth, embed and head do not
        extrapolated = (scale * draft_layers + head) / (scale * full_layers + head)
        print(f"{f'{b}/{top_k}':>8} {draft:9.2f} {draft / full:6.3f} {extrapolated:16.3f}")


if __name__ == "__main__":
    main()
