"""The model adapter: run any list of a Hugging Face decoder's own layers on one shared KV cache.

`embed`, `run_layers(h, layers, start, cache)` and `head` are all a drafter or the verify needs.
Depth is an argument: a draft passes `layers=range(k)` (early exit at k) or any other list, and
nothing in the HF model or its config is mutated. The adapter calls the model's own submodules
(projections, norms, MLPs) with the weights transformers loaded, never a copy; only the attention
glue (rotary, cache write, masked SDPA) is ours, so that it reads and writes our cache by position.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from selfspec.native import gemv
from selfspec.model.cache import KVCache
from selfspec.model.head_screen import top1_logits
from selfspec.model.moe import routed
from selfspec.model.quantize import Int4Linear
from selfspec.model.skips import SkipSet
from selfspec.model.step import LeanStep, pad_rows

NO_SKIP = SkipSet()
CAPACITY_STEP = 512  # the lean step's cache capacities are multiples of this

# model_type -> block layout. "pre-norm": Llama-style (norm before attention and MLP);
# "sandwich": Gemma 3 (norms before and after both attention and MLP).
ARCHITECTURES = {
    "llama": "pre-norm",
    "mistral": "pre-norm",
    "qwen2": "pre-norm",
    "qwen3": "pre-norm",
    "phi3": "pre-norm",
    "gemma3_text": "sandwich",
    # Mixture-of-experts decoders: Llama-style blocks whose `mlp` is a sparse MoE block (selfspec.model.moe).
    "mixtral": "pre-norm",
    "qwen2_moe": "pre-norm",
    "qwen3_moe": "pre-norm",
}
# Model types left out on purpose, with the reason the error gives.
UNSUPPORTED = {
    "olmoe": "OLMoE normalises q and k over the whole projection (all heads together) and may clip q, k, v; "
             "selfspec's attention normalises per head (Qwen3), so it would not compute OLMoE's attention",
}


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class LayerSpec:
    window: int | None  # sliding-window size (a key is visible while q - kv < window), None for full attention
    rope: str  # which rotary table this layer uses (Gemma 3: local and global layers differ)


class LayerHooks:
    """How a probe or a draft of an adaptive family looks inside the layers it runs, or changes
    their MLPs, without extra arguments on `run_layers`. The base runs the layers as they are."""

    def sublayer(self, kind: str, layer: int, residual: torch.Tensor) -> None:
        """Each sublayer's output, the residual it adds: kind "attn" or "mlp"."""

    def mlp(self, layer: int, block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s MLP (or MoE block) on x."""
        return block(x)


NO_HOOKS = LayerHooks()


class Recorder(LayerHooks):
    """Keeps each sublayer's output, keyed ("attn", i) and ("mlp", i) (ConfLayers' probe)."""

    def __init__(self):
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}

    def sublayer(self, kind: str, layer: int, residual: torch.Tensor) -> None:
        self.outputs[kind, layer] = residual


class ExpertBudget(LayerHooks):
    """Routes each MoE layer's tokens to only `experts` experts (expert-subset's draft; see
    selfspec.model.moe); dense MLPs run as they are."""

    def __init__(self, experts: int):
        self.experts = experts

    def mlp(self, layer: int, block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return routed(block, x, self.experts)


class ModelAdapter:
    def __init__(self, hf_model: torch.nn.Module):
        config = hf_model.config
        model_type = getattr(config, "model_type", None)
        if model_type in UNSUPPORTED:
            raise UnsupportedModelError(f"selfspec does not support {model_type!r}: {UNSUPPORTED[model_type]}")
        if model_type not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"selfspec cannot split model type {model_type!r} into layers; supported: "
                f"{', '.join(sorted(ARCHITECTURES))} (Llama, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3 text, "
                f"Mixtral, Qwen2-MoE, Qwen3-MoE)"
            )
        if getattr(config, "use_bidirectional_attention", False):
            raise UnsupportedModelError("bidirectional attention is not a decoder: cannot speculate on it")
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise UnsupportedModelError("attention logit soft-capping is not supported")
        self.hf_model = hf_model
        self.config = config
        self.layout = ARCHITECTURES[model_type]
        body = hf_model.model
        self.embed_tokens = body.embed_tokens  # Gemma 3's embedding scales by sqrt(hidden) itself
        self.layers = body.layers
        self.norm = body.norm
        self.lm_head = hf_model.lm_head
        self.rotary = body.rotary_emb
        self.n_layers = len(self.layers)
        attn0 = self.layers[0].self_attn
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = attn0.head_dim
        self.scale = attn0.scaling
        self.max_positions = getattr(config, "max_position_embeddings", None) or 2048
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * self.n_layers
        self.specs = [
            LayerSpec(
                window=_window(config, layer.self_attn, i),
                rope=layer_types[i],
            )
            for i, layer in enumerate(self.layers)
        ]
        self._rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._rope_by_type = "layer_type" in inspect.signature(self.rotary.forward).parameters
        self.step: LeanStep | None = None  # the lean step, once `lean()` turned it on
        self._cache_pool: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # capacity -> free storage

    def lean(self, *, compile: bool = False, exact_rows: int | None = None, backend=None,
             graph_factory=None) -> LeanStep:
        """Route plain layer runs (every draft and verify that writes the cache) through the lean
        step (selfspec.model.step): fused weights, one attention call over the static cache, eager or
        compiled per row bucket. exact_rows: run every forward in that many rows (exact mode).
        graph_factory: capture exact mode's forwards with it (a CPU stand-in for CUDA graphs, tests)."""
        if (backend is not None or graph_factory is not None or self.step is None
                or (self.step.compile, self.step.exact_rows) != (compile, exact_rows)):
            self.step = LeanStep(self, compile=compile, exact_rows=exact_rows, backend=backend,
                                 graph_factory=graph_factory)
        return self.step

    @property
    def exact(self) -> bool:
        """Every forward runs one fixed row bucket (see selfspec.model.step): greedy identity by construction."""
        return self.step is not None and self.step.exact_rows is not None

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the embedding's: quantized heads and layers compute in it)."""
        return self.embed_tokens.weight.dtype

    def new_cache(self, capacity: int) -> KVCache:
        if self.step is not None:
            # One scratch slot for padding rows; compiled, capacities rounded up so that compiled
            # code (specialised on the cache's shape) is shared by generations of similar length.
            capacity += 1
            if self.step.compile or self.step.graphs is not None:  # graphs: keyed by the cache, too
                capacity = -(-capacity // CAPACITY_STEP) * CAPACITY_STEP
        self._ensure_rope(capacity)
        pooled = self.step is not None and self.step.graphs is not None
        # Graphed forwards are keyed by the cache's address: a cache that is no longer used returns
        # its storage to a pool, and the next generation of that capacity reuses it and its graphs.
        free = self._cache_pool.setdefault(capacity, []) if pooled else []
        cache = KVCache(self.n_layers, self.n_kv_heads, self.head_dim, capacity, dtype=self.dtype, device=self.device,
                        storage=free.pop() if free else None)
        if pooled:
            weakref.finalize(cache, free.append, (cache.keys, cache.values))
        if self.step is not None and self.step.compile and self.device.type == "cuda" and not pooled:
            # torch.compile's own CUDA graphs (mode="reduce-overhead", outside exact mode) replay
            # fixed addresses: the cache, which every layer writes in place, is a static input, not
            # one copied in and out of the graph. (Coded; not yet measured. In exact mode
            # selfspec.model.cuda_graphs captures whole forwards instead and compiles without graphs.)
            torch._dynamo.mark_static_address(cache.keys)
            torch._dynamo.mark_static_address(cache.values)
        return cache

    def runs_fused(self, rows: int) -> bool:
        """Whether the fused layer runs a forward of `rows` rows (eager lean step, the kernel built,
        at most its ROWS rows): each row's arithmetic is then its own, whatever the rows beside it."""
        from selfspec.native import fused_layer

        return self.step is not None and self.step.fused is not None and rows <= fused_layer.ROWS

    def runs_siblings(self, rows: int) -> bool:
        """Whether a forward of `rows` rows can take sibling rows (run_layers' siblings=True): only
        in the fused layer."""
        return self.runs_fused(rows)

    # -- the three entry points -------------------------------------------------------------

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token ids [n] -> hidden states [1, n, hidden]."""
        return self.embed_tokens(token_ids.view(1, -1))

    def run_layers(
        self,
        h: torch.Tensor,
        layers,
        start: int,
        cache: KVCache,
        *,
        rowwise: bool = False,
        skip: SkipSet = NO_SKIP,
        write: bool = True,
        hooks: LayerHooks | None = None,
        siblings: bool = False,
    ) -> torch.Tensor:
        """Run `layers` (indices, in order) on h [1, n, hidden] at positions start .. start+n-1.

        Each layer writes its keys/values for those positions into `cache` and attends to
        the cache's earlier positions of the same layer.

        skip: sublayers to leave out (a draft); a skipped attention writes nothing.
        write=False: a probe that leaves the cache untouched: the rows attend to the cache's
        positions < start and to their own keys. A probe may also take h [b, 1, hidden]: b
        candidate states of one token at position `start`, each attending to the cache and itself.
        hooks: how an adaptive family looks inside the layers or changes their MLPs (LayerHooks:
        ConfLayers records each sublayer's output; expert-subset routes MoE layers to fewer
        experts); None runs the layers as they are.
        siblings=True: rows 1.. are alternative tokens for position start+1, in slots start+1 ..
        start+n-1, each attending to positions <= start and itself (a sibling verify; only where
        `runs_siblings`).

        rowwise=True (the verify) keeps every row's result as close as it can be to running its
        token alone, as autoregressive decoding does: attention runs one query row at a time,
        because CPU SDPA kernels block the keys by length and give a row different rounding in a
        batch (in bfloat16 that flipped greedy tokens). The projections and MLPs batch the rows;
        a GEMM over several rows is not bit-identical to the one-row product either (float32 on
        this CPU: up to ~4e-5 absolute on the logit scale), so greedy output equals AR unless two
        top logits lie within that rounding of each other (never seen in the tests or benchmarks).
        """
        n = h.shape[1]
        if self.step is not None and write and hooks is None and h.shape[0] == 1:
            return self.step.run(h, layers, start, cache, skip, siblings, verify=rowwise)
        if siblings:
            raise ValueError("sibling rows run only in the fused layer (ModelAdapter.runs_siblings)")
        if h.shape[0] > 1 and (write or n > 1):
            raise ValueError("a batch of candidate states is only supported as a one-position probe (write=False)")
        masks: dict[int | None, torch.Tensor | None] = {}
        for i in layers:
            spec = self.specs[i]
            if spec.window not in masks:
                masks[spec.window] = None if rowwise else _causal_mask(start, n, spec.window, self.device)
            h = self._layer(i, h, start, cache, masks[spec.window], rowwise, skip, write, hooks or NO_HOOKS)
            if write and cache.exit_layer == i + 1:  # h_k, beside layer k-1's keys (see KVCache)
                cache.write_exit_states(start, h)
        return h

    def run_rows(self, h: torch.Tensor, layers, starts: list[int], caches: list[KVCache]) -> torch.Tensor:
        """Run `layers` on rows of different sequences: h [B, n, hidden], row b at positions
        starts[b] .. starts[b]+n-1 of its own cache caches[b] (a batched verify).

        Where the lean step runs n rows of one sequence through the fused layer (LeanStep.runs_rowwise),
        it takes the sequences together (as many a call as its ROWS hold), every row's bits its
        one-sequence call's. Elsewhere projections and MLPs batch
        all B·n rows; attention runs per row and per query over that row's own cache, exactly as
        `run_layers(..., rowwise=True)` does for one sequence, so every row's result is the one its
        sequence would get alone within the products' rounding.
        """
        if len(starts) != h.shape[0] or len(caches) != h.shape[0]:
            raise ValueError(f"{h.shape[0]} rows need as many starts and caches, got {len(starts)} and {len(caches)}")
        if self.step is not None and self.step.runs_rowwise(h.shape[1]) and not gemv.needs_grad(h):
            return self.step.fused.run_rows(h, list(layers), list(starts), list(caches))  # the lone verify's bits
        rows = _Rows(list(starts), list(caches))
        for i in layers:
            h = self._layer(i, h, rows, None, None, True, NO_SKIP, True, NO_HOOKS)
            for b, (start, cache) in enumerate(zip(rows.starts, rows.caches)):
                if cache.exit_layer == i + 1:  # h_k, beside layer k-1's keys (see KVCache)
                    cache.write_exit_states(start, h[b])
        return h

    def run_ragged(self, x: torch.Tensor, layers, starts: list[int], counts: list[int],
                   caches: list[KVCache]) -> torch.Tensor:
        """`run_rows` for sequences of different row counts: x [sum(counts), hidden], counts[b] rows
        of sequence b in turn. Through the fused layer unpadded (one call a layer for as many rows
        as a call takes: FusedLayers.run_ragged), else padded to the longest (with its last row) and
        run by `run_rows`. Every row is its sequence's lone verify's, as there."""
        if len(starts) != len(counts) or len(caches) != len(counts) or sum(counts) != x.shape[0]:
            raise ValueError(f"{x.shape[0]} rows need row counts adding up to them, and a start and cache each")
        if self.ragged_rows(max(counts)) and not gemv.needs_grad(x):
            return self.step.fused.run_ragged(x, list(layers), list(starts), list(counts), list(caches))
        n, rows, row = max(counts), [], 0
        for count in counts:
            part = x[row:row + count]
            rows.append(torch.cat([part, part[-1:].expand(n - count, -1)]))
            row += count
        h = self.run_rows(torch.stack(rows), layers, starts, caches)
        return torch.cat([h[b, :count] for b, count in enumerate(counts)])

    def ragged_rows(self, n: int) -> int:
        """The most rows one call of a ragged batched verify takes where sequences of up to n rows
        each share calls unpadded (`run_ragged` through the fused layer); 0 where they are padded.
        A decode forward's ROWS (a 4-bit call of more runs the prefill's tiles: 20 rows of the 0.5B
        cost 9 steps there against 6.6 in two calls, 2-core AMD EPYC)."""
        from selfspec.native import fused_layer

        return fused_layer.ROWS if self.step is not None and self.step.runs_rowwise(n) else 0

    def head(self, h: torch.Tensor, top1: bool = False) -> torch.Tensor:
        """hidden states [1, n, hidden] -> logits [n, vocab] in float32. top1: only each row's
        argmax is wanted (greedy): an int8 head with a screen then computes only the logits that
        could be the largest, the rest -inf (selfspec.model.head_screen)."""
        n = h.shape[1]
        if self.exact:  # the head runs the same bucket of rows as every layer (see selfspec.model.step)
            h = pad_rows(h, self.step.exact_rows, dim=1)
        return self.head_rows(h, live=n, top1=top1)[0, :n]

    def head_rows(self, h: torch.Tensor, live: int | None = None, top1: bool = False) -> torch.Tensor:
        """hidden states [B, n, hidden] -> logits [B, n, vocab] in float32. live: with B = 1, only
        the first `live` rows are wanted (the rest pad exact mode's bucket); the gemv kernel then
        computes only those, as its rows do not depend on each other (selfspec.native.gemv).
        top1: as in `head`."""
        x = self.norm(h)
        rows = x.reshape(-1, x.shape[-1]) if live is None or x.shape[0] != 1 else x[0, :live]
        # A verify's rows (one sequence's, or a batched verify's several) in calls of up to
        # gemv.MAX_ROWS rows, each row's bits its own; a long run of one sequence's rows (a
        # calibration's teacher) as one product.
        if self._head_rowwise(rows) and (rows.shape[0] <= gemv.MAX_ROWS or x.shape[0] > 1):
            head = self.lm_head  # a 4-bit head's kernel, else the int8 or bfloat16 one of the layers
            if isinstance(head, Int4Linear):
                part = head
            else:
                def part(chunk, weight=head.weight, scale=getattr(head, "scale", None)):
                    return gemv.linear(chunk, weight, head.bias, scale)

            def product(rows):
                return torch.cat([part(rows[i:i + gemv.MAX_ROWS]) for i in range(0, rows.shape[0], gemv.MAX_ROWS)])

            logits = self._screened(rows, part) if top1 else None
            if logits is None:
                logits = product(rows)
            logits = logits.view(x.shape[0], -1, logits.shape[-1]).float()
        else:
            logits = self.lm_head(x).float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def _screened(self, rows: torch.Tensor, part) -> torch.Tensor | None:
        """top1 logits of rows [n, hidden] through the head's screen (selfspec.model.head_screen),
        the candidates' from the head's own kernel (`part` on their gathered rows); None where
        there is no screen, or it cannot tell."""
        screen = getattr(self.lm_head, "screen", None)
        if screen is None or self.lm_head.bias is not None or self.final_softcap is not None:
            return None  # a soft-cap's float tanh may tie what the screen told apart

        def exact(x, vocab):
            weight = self.lm_head.weight.index_select(0, vocab)
            scale = self.lm_head.scale.index_select(0, vocab)
            return torch.cat([part(x[i:i + gemv.MAX_ROWS], weight, scale) for i in range(0, x.shape[0], gemv.MAX_ROWS)])

        return top1_logits(rows, screen, exact)

    def _head_rowwise(self, rows: torch.Tensor) -> bool:
        """Whether the head takes these rows through a kernel whose rows do not depend on each other
        (selfspec.native.gemv's, up to gemv.MAX_ROWS a call): a 4-bit head in blocks, or a head the
        lean step's products run."""
        if isinstance(self.lm_head, Int4Linear):
            return self.lm_head.layout == "blocks" and rows.dtype == torch.bfloat16 and not gemv.needs_grad(rows)
        return (self.step is not None and self.step.shape.gemv
                and gemv.supports(rows[:gemv.MAX_ROWS], self.lm_head.weight))

    def batches_exactly(self, n: int) -> bool:
        """Whether a batched verify of n rows a sequence (`run_rows`, `head_rows`) gives every row
        its lone verify's bits, so exact mode may share one forward among sequences: the layers run
        through the fused layer (LeanStep.runs_rowwise: a lone verify runs there too, unpadded),
        the head through a row-invariant kernel."""
        if self.step is None or not self.step.runs_rowwise(n):
            return False
        sample = torch.empty(1, self.lm_head.in_features, dtype=self.dtype)
        return self._head_rowwise(sample)

    # -- one decoder layer --------------------------------------------------------------------

    def _layer(self, i, h, start, cache, mask, rowwise, skip, write, hooks) -> torch.Tensor:
        layer = self.layers[i]
        sandwich = self.layout == "sandwich"
        if i not in skip.attn:
            x = layer.input_layernorm(h) if sandwich else _rms_norm(layer.input_layernorm, h)
            a = self._attention(i, x, start, cache, mask, rowwise, write)
            if sandwich:
                a = layer.post_attention_layernorm(a)
            hooks.sublayer("attn", i, a)
            h = h + a
        if i not in skip.mlp:
            x = layer.pre_feedforward_layernorm(h) if sandwich else _rms_norm(layer.post_attention_layernorm, h)
            m = hooks.mlp(i, layer.mlp, x)
            if sandwich:
                m = layer.post_feedforward_layernorm(m)
            hooks.sublayer("mlp", i, m)
            h = h + m
        return h

    def _attention(self, i, x, start, cache, mask, rowwise, write=True) -> torch.Tensor:
        attn = self.layers[i].self_attn
        b, n = x.shape[:2]
        if hasattr(attn, "qkv_proj"):  # Phi-3 fuses the three projections
            q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
            q, k, v = attn.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        q = q.view(b, n, self.n_heads, self.head_dim).transpose(1, 2)  # [b, heads, n, head_dim]
        k = k.view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # Qwen3, Gemma 3: per-head RMSNorm before rotary
            q, k = _rms_norm(attn.q_norm, q), _rms_norm(attn.k_norm, k)
        spec = self.specs[i]
        cos, sin = self._rope[spec.rope]
        if isinstance(start, _Rows):
            out = self._attention_rows(i, q, k, v, start, cos, sin)
            return attn.o_proj(out.transpose(1, 2).reshape(b, n, self.n_heads * self.head_dim))
        cos, sin = cos[start : start + n], sin[start : start + n]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if not write:
            out = self._sdpa_probe(i, q, k, v, start, cache, mask)
        elif rowwise and n > 1:
            cache.write(i, start, k, v)
            out = torch.cat([self._sdpa(i, q[:, :, j : j + 1], start + j, cache, None) for j in range(n)], dim=2)
        else:
            cache.write(i, start, k, v)
            out = self._sdpa(i, q, start, cache, mask)
        return attn.o_proj(out.transpose(1, 2).reshape(b, n, self.n_heads * self.head_dim))

    def _attention_rows(self, i, q, k, v, rows: _Rows, cos, sin) -> torch.Tensor:
        """Attention for rows of different sequences (see run_rows): q, k, v [B, heads, n, head_dim]."""
        n = q.shape[2]
        index = torch.tensor(rows.starts, device=q.device).view(-1, 1) + torch.arange(n, device=q.device)
        cos, sin = cos[index].unsqueeze(1), sin[index].unsqueeze(1)  # [B, 1, n, rotary_dim]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = []
        for b, (start, cache) in enumerate(zip(rows.starts, rows.caches)):
            cache.write(i, start, k[b : b + 1], v[b : b + 1])
            out.append(torch.cat([self._sdpa(i, q[b : b + 1, :, j : j + 1], start + j, cache, None)
                                  for j in range(n)], dim=2))  # [1, heads, n, head_dim]
        return torch.cat(out, dim=0)

    def _sdpa(self, i: int, q: torch.Tensor, start: int, cache: KVCache, mask) -> torch.Tensor:
        """Attention of queries q [1, heads, n, head_dim] at start .. start+n-1 over the cache."""
        n = q.shape[2]
        window = self.specs[i].window
        kv_start = 0 if window is None else max(0, start - window + 1)
        keys, values = cache.view(i, kv_start, start + n)
        # A block that starts at key 0 with no window is plain causal: SDPA's own causal path is
        # faster than an explicit mask (the prefill of a long prompt).
        causal = mask is not None and kv_start == 0 and start == 0 and window is None
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=None if causal else mask, is_causal=causal, scale=self.scale,
            enable_gqa=self.n_heads != self.n_kv_heads,
        )

    def _sdpa_probe(self, i, q, k, v, start, cache, mask) -> torch.Tensor:
        """Attention over the cache's positions < start plus the queries' own keys k, v
        [b, kv_heads, n, head_dim], without writing them anywhere."""
        b = q.shape[0]
        window = self.specs[i].window
        kv_start = 0 if window is None else max(0, start - window + 1)
        keys, values = cache.view(i, kv_start, start)
        keys = torch.cat([keys.expand(b, -1, -1, -1), k], dim=2)
        values = torch.cat([values.expand(b, -1, -1, -1), v], dim=2)
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=self.n_heads != self.n_kv_heads
        )

    def rope_tables(self, capacity: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The rotary tables by rope type, cos and sin [positions, rotary_dim] each, covering at least
        `capacity` positions (they grow as caches do; fused kernels and CUDA graphs read them)."""
        if capacity or not self._rope:
            self._ensure_rope(max(capacity, 1))
        return self._rope

    def _ensure_rope(self, capacity: int) -> None:
        """Tabulate cos/sin for positions < capacity with the model's own rotary module."""
        have = next(iter(self._rope.values()))[0].shape[0] if self._rope else 0
        if have >= capacity:
            return
        positions = torch.arange(capacity, device=self.device).view(1, -1)
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        for rope in {spec.rope for spec in self.specs}:
            args = (probe, positions, rope) if self._rope_by_type else (probe, positions)
            cos, sin = self.rotary(*args)
            self._rope[rope] = (cos[0], sin[0])  # [capacity, rotary_dim]


@dataclass(frozen=True)
class _Rows:
    """Where each row of a batch of sequences sits: its first position and its own cache."""

    starts: list[int]
    caches: list[KVCache]


def _window(config, attn: torch.nn.Module, i: int) -> int | None:
    """Layer i's sliding window, None for full attention. The attention module's own
    `sliding_window` wins; without one, a config with per-layer `layer_types` marks full layers
    (Qwen2-MoE sets the attribute on its sliding layers only), else the config's window applies
    to every layer (Mistral, Mixtral). 0 means none (Qwen2-MoE without use_sliding_window)."""
    if hasattr(attn, "sliding_window"):
        window = attn.sliding_window
    elif getattr(config, "layer_types", None) is not None and config.layer_types[i] == "full_attention":
        window = None
    else:
        window = getattr(config, "sliding_window", None)
    return window or None


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The Llama-family RMSNorm (statistics in float32, weight applied in the input dtype) as one
    fused op where possible: about half the time of the module's seven small ops, same result.
    Gemma 3's (1 + weight) norm has no `variance_epsilon` and runs as its own module."""
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None:
        return norm(x)
    if x.dtype == torch.float32:
        return F.rms_norm(x, norm.weight.shape, norm.weight, eps)
    return norm.weight * F.rms_norm(x.float(), norm.weight.shape, None, eps).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the first rotary_dim features (all of them unless partial, as Phi-3.5)."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([_rotate(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    half = rot // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _causal_mask(start: int, n: int, window: int | None, device) -> torch.Tensor | None:
    """Boolean mask [n, kv_len] (True = may attend) for queries at start .. start+n-1.

    Keys run from kv_start (0, or the first key inside the window) to start+n-1. A single query
    needs no mask: the key range itself already is the window.
    """
    if n == 1:
        return None
    kv_start = 0 if window is None else max(0, start - window + 1)
    q_pos = torch.arange(start, start + n, device=device).view(n, 1)
    kv_pos = torch.arange(kv_start, start + n, device=device).view(1, -1)
    allowed = kv_pos <= q_pos
    if window is not None:
        allowed &= kv_pos > q_pos - window
    return allowed
