"""The model adapter: run any list of a Hugging Face decoder's own layers on one shared KV cache.

`embed`, `run_layers(h, layers, start, cache)` and `head` are all a drafter or the verify needs.
Depth is an argument: a draft passes `layers=range(k)` (early exit at k) or any other list, and
nothing in the HF model or its config is mutated. The adapter calls the model's own submodules
(projections, norms, MLPs) with the weights transformers loaded, never a copy; only the attention
glue (rotary, cache write, masked SDPA) is ours, so that it reads and writes our cache by position.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from selfspec.cache import KVCache
from selfspec.skips import SkipSet

NO_SKIP = SkipSet()

# model_type -> block layout. "pre-norm": Llama-style (norm before attention and MLP);
# "sandwich": Gemma 3 (norms before and after both attention and MLP).
ARCHITECTURES = {
    "llama": "pre-norm",
    "mistral": "pre-norm",
    "qwen2": "pre-norm",
    "qwen3": "pre-norm",
    "phi3": "pre-norm",
    "gemma3_text": "sandwich",
}


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class LayerSpec:
    window: int | None  # sliding-window size (a key is visible while q - kv < window), None for full attention
    rope: str  # which rotary table this layer uses (Gemma 3: local and global layers differ)


class ModelAdapter:
    def __init__(self, hf_model: torch.nn.Module):
        config = hf_model.config
        model_type = getattr(config, "model_type", None)
        if model_type not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"selfspec cannot split model type {model_type!r} into layers; supported: "
                f"{', '.join(sorted(ARCHITECTURES))} (Llama, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3 text)"
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
                window=getattr(layer.self_attn, "sliding_window", getattr(config, "sliding_window", None)),
                rope=layer_types[i],
            )
            for i, layer in enumerate(self.layers)
        ]
        self._rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._rope_by_type = "layer_type" in inspect.signature(self.rotary.forward).parameters

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_cache(self, capacity: int) -> KVCache:
        self._ensure_rope(capacity)
        return KVCache(
            self.n_layers, self.n_kv_heads, self.head_dim, capacity, dtype=self.dtype, device=self.device
        )

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
        record: dict | None = None,
    ) -> torch.Tensor:
        """Run `layers` (indices, in order) on h [1, n, hidden] at positions start .. start+n-1.

        Each layer writes its keys/values for those positions into `cache` and attends to
        the cache's earlier positions of the same layer.

        skip: sublayers to leave out (a draft); a skipped attention writes nothing.
        write=False: a probe that leaves the cache untouched: the rows attend to the cache's
        positions < start and to their own keys. A probe may also take h [b, 1, hidden]: b
        candidate states of one token at position `start`, each attending to the cache and itself.
        record: if a dict, receives each sublayer's output (the residual it adds), keyed
        ("attn", i) and ("mlp", i).

        rowwise=True (the verify) makes every row's result bit-identical to running its token
        alone, as autoregressive decoding does: the projections and MLPs batch the rows (their
        kernels are row-invariant), but attention runs one query row at a time, because CPU SDPA
        kernels block the keys by length and give a row different rounding in a batch. In
        bfloat16 that rounding flips greedy tokens; with it, output stays token-identical to AR.
        """
        n = h.shape[1]
        if h.shape[0] > 1 and (write or n > 1):
            raise ValueError("a batch of candidate states is only supported as a one-position probe (write=False)")
        masks: dict[int | None, torch.Tensor | None] = {}
        for i in layers:
            spec = self.specs[i]
            if spec.window not in masks:
                masks[spec.window] = None if rowwise else _causal_mask(start, n, spec.window, self.device)
            h = self._layer(i, h, start, cache, masks[spec.window], rowwise, skip, write, record)
        return h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """hidden states [1, n, hidden] -> logits [n, vocab] in float32."""
        logits = self.lm_head(self.norm(h))[0].float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    # -- one decoder layer --------------------------------------------------------------------

    def _layer(self, i, h, start, cache, mask, rowwise, skip, write, record) -> torch.Tensor:
        layer = self.layers[i]
        sandwich = self.layout == "sandwich"
        if i not in skip.attn:
            x = layer.input_layernorm(h) if sandwich else _rms_norm(layer.input_layernorm, h)
            a = self._attention(i, x, start, cache, mask, rowwise, write)
            if sandwich:
                a = layer.post_attention_layernorm(a)
            if record is not None:
                record["attn", i] = a
            h = h + a
        if i not in skip.mlp:
            x = layer.pre_feedforward_layernorm(h) if sandwich else _rms_norm(layer.post_attention_layernorm, h)
            m = layer.mlp(x)
            if sandwich:
                m = layer.post_feedforward_layernorm(m)
            if record is not None:
                record["mlp", i] = m
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
