"""The fused decoder layer (selfspec.native.fused_layer, kernels/layer.cpp): the same logits as PyTorch's
lean step within rounding, every row's bits independent of the rows beside it and of the thread
count (so verify rows are AR's rows in every mode), and the models it declines."""

import pytest
import torch

from lossless import PROMPT, REPETITIVE, assert_greedy_lossless
from selfspec.native import fused_layer, gemv
from selfspec.api import SelfSpecModel
from selfspec.model.quantize import quantize_int4, quantize_int8
from tiny_models import COMMON, VOCAB, build, tiny_model

pytestmark = pytest.mark.skipif(not gemv.available(), reason="no g++ or no AVX2/FMA: the lean step uses PyTorch's kernels")
FUSED = ["llama", "mistral", "qwen2", "qwen3", "gemma3_text", "llama_hd64"]  # every tiny architecture but phi3 (partial rotary)


def _model(arch, dtype=torch.float32, int8=False, int4=False):
    """A tiny model; int8 or int4 (selfspec's 4-bit blocks, which the fused layer runs) quantized."""
    dtype = torch.bfloat16 if int8 or int4 else dtype
    if arch == "llama_hd64":  # the head sizes with their own attention code (64, 128, 256)
        from transformers import LlamaConfig
        hf = build(LlamaConfig(**{**COMMON, "head_dim": 64}), 0, dtype)
    else:
        hf = tiny_model(arch, dtype=dtype)
    if int8:
        quantize_int8(hf)
    if int4:
        quantize_int4(hf, layout="blocks")
    return SelfSpecModel(hf)


def _quantized(arch, dtype):
    """_model for a dtype parameter: torch.float32, torch.bfloat16, "int8" or "int4"."""
    return _model(arch, torch.bfloat16 if isinstance(dtype, str) else dtype, int8=dtype == "int8", int4=dtype == "int4")


def _logits(adapter, ids, prefill):
    """A prefill (PyTorch's path when longer than fused_layer.ROWS), then one token at a time."""
    with torch.inference_mode():
        cache = adapter.new_cache(len(ids) + 1)
        out = [adapter.head(adapter.run_layers(adapter.embed(ids[:prefill]), range(adapter.n_layers), 0, cache))]
        for t in range(prefill, len(ids)):
            out.append(adapter.head(adapter.run_layers(adapter.embed(ids[t:t + 1]), range(adapter.n_layers), t, cache)))
    return torch.cat(out)


@pytest.mark.parametrize("arch", FUSED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "int8", "int4"])
def test_fused_layer_matches_pytorchs_lean_step(arch, dtype, path):
    model = _quantized(arch, dtype)
    adapter = model.adapter
    assert adapter.step.fused is not None
    ids = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(3))
    fused = _logits(adapter, ids, 20)  # positions 20..29 fused, past every tiny sliding window
    adapter.step.fused = None
    reference = _logits(adapter, ids, 20)
    if dtype == torch.float32:
        torch.testing.assert_close(fused, reference, atol=1e-4, rtol=1e-4)
    else:  # bfloat16 activations: each op rounds to 8 bits, in a slightly different order
        assert (fused - reference).abs().max() < 0.05 * reference.abs().max()
        # The same greedy token, or one within bfloat16 rounding of the best (a near tie)
        gap = reference.max(-1).values - reference.gather(-1, fused.argmax(-1, keepdim=True))[:, 0]
        assert (gap <= 0.25).all() and (gap == 0).float().mean() >= 0.9, gap


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text", "llama_hd64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "int8", "int4"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_bits_do_not_depend_on_its_neighbours_or_threads(arch, dtype, threads, path):
    """A 16-row forward (a verify) gives each row exactly what a one-row forward (an AR step) at
    that position gives it, with any thread count: greedy identity by construction."""
    model = _quantized(arch, dtype)
    adapter = model.adapter
    ids = torch.randint(0, VOCAB, (26,), generator=torch.Generator().manual_seed(4))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        one_by_one = _logits(adapter, ids, 10)[10:]  # the prefill's 10 rows dropped
        torch.set_num_threads(3 - threads)  # the other thread count for the verify
        with torch.inference_mode():
            cache = adapter.new_cache(len(ids) + 1)
            adapter.run_layers(adapter.embed(ids[:10]), range(adapter.n_layers), 0, cache)
            together = adapter.head(adapter.run_layers(adapter.embed(ids[10:]), range(adapter.n_layers), 10, cache))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(together, one_by_one)


@pytest.mark.parametrize("head_dim, window", [(64, None), (128, None), (64, 50)])
def test_verify_rows_reading_a_long_context_together_are_the_one_row_steps(head_dim, window, path):
    """Past 16 shared keys, the rows of a bfloat16 verify read each key once for all of them
    (kernels/layer.h, attend16_rows: 64- and 128-wide heads on the AVX-512 paths); each row still
    gets exactly what its one-row step gets, and so do rows whose sliding windows start apart
    (window 50: rows at positions past 49 start their keys at different slots)."""
    from transformers import LlamaConfig, MistralConfig

    shape = {**COMMON, "head_dim": head_dim}
    config = MistralConfig(**shape, sliding_window=window) if window else LlamaConfig(**shape)
    adapter = SelfSpecModel(build(config, 0, torch.bfloat16)).adapter
    assert adapter.step.fused is not None
    ids = torch.randint(0, VOCAB, (56,), generator=torch.Generator().manual_seed(5))
    one_by_one = _logits(adapter, ids, 40)[40:]
    for n in (2, 3, 4, 16):
        with torch.inference_mode():
            cache = adapter.new_cache(len(ids) + 1)
            adapter.run_layers(adapter.embed(ids[:40]), range(adapter.n_layers), 0, cache)
            together = adapter.head(adapter.run_layers(adapter.embed(ids[40:40 + n]), range(adapter.n_layers), 40, cache))
        assert torch.equal(together, one_by_one[:n]), n


def test_rows_attending_together_move_no_bit(monkeypatch):
    """The build's rows per attention task ($SELFSPEC_ATTN_ROWS; 4 on the AVX-512 path, 1 on the
    pair and AMX paths) changes no result: a 16-row bfloat16 verify over a 40-key context with
    64-wide heads gives the one-row steps' logits with 1, 2 and 4. On a CPU with AVX512-BF16 this
    is the test of the pair path's attend16_rows, which its default build leaves off."""
    from transformers import LlamaConfig

    ids = torch.randint(0, VOCAB, (56,), generator=torch.Generator().manual_seed(6))
    one_by_one = None
    for rows in ("1", "2", "4"):
        monkeypatch.setenv("SELFSPEC_ATTN_ROWS", rows)
        assert gemv._attention_rows(gemv.kernel_path()) == int(rows)
        monkeypatch.setitem(gemv._STATE, "lib", gemv._build())
        adapter = SelfSpecModel(build(LlamaConfig(**{**COMMON, "head_dim": 64}), 0, torch.bfloat16)).adapter
        if one_by_one is None:
            one_by_one = _logits(adapter, ids, 40)[40:]
        with torch.inference_mode():
            cache = adapter.new_cache(len(ids) + 1)
            adapter.run_layers(adapter.embed(ids[:40]), range(adapter.n_layers), 0, cache)
            together = adapter.head(adapter.run_layers(adapter.embed(ids[40:]), range(adapter.n_layers), 40, cache))
        assert torch.equal(together, one_by_one), rows
    monkeypatch.setenv("SELFSPEC_ATTN_ROWS", "5")
    with pytest.raises(ValueError, match="SELFSPEC_ATTN_ROWS must be 1, 2, 3 or 4"):
        gemv._attention_rows("avx512")
    monkeypatch.delenv("SELFSPEC_ATTN_ROWS")
    assert gemv._attention_rows("avx512") == 4 and gemv._attention_rows("pairs") == 1


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3"])
def test_bfloat16_default_mode_is_lossless_for_every_drafter_kind(arch):
    model = _model(arch, torch.bfloat16)
    assert model.adapter.step.fused is not None and model.adapter.step.exact_rows is None
    for options in [dict(method="early-exit", exit_layer=2, draft_len=5),
                    dict(method="layer-skip", skip="attn:1,3 mlp:2,4", draft_len=4)]:
        assert assert_greedy_lossless(model, **options).stats.drafted > 0
    assert_greedy_lossless(model, prompt=REPETITIVE, method="lookup", draft_len=7)


def test_exit_states_and_skips_run_through_the_fused_layer():
    """A layer-skip draft and early exit's kept h_k take the fused path and agree with PyTorch's."""
    model = _model("llama")
    adapter = model.adapter
    from selfspec.model.skips import SkipSet
    skip = SkipSet(attn=frozenset({1, 3}), mlp=frozenset({2}))
    ids = torch.tensor(PROMPT)
    results = []
    for fused in (adapter.step.fused, None):
        adapter.step.fused = fused
        with torch.inference_mode():
            cache = adapter.new_cache(20)
            cache.keep_exit_states(3, adapter.embed_tokens.weight.shape[1])
            h = adapter.run_layers(adapter.embed(ids), range(adapter.n_layers), 0, cache, skip=skip)
            results.append((h.clone(), cache.exit_states[: len(PROMPT)].clone()))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-5, rtol=1e-5)
    assert results[0][1].abs().sum() > 0


def test_which_models_run_fused(monkeypatch):
    assert SelfSpecModel(tiny_model("llama")).adapter.step.fused is not None
    assert SelfSpecModel(tiny_model("phi3")).adapter.step.fused is None  # partial rotary
    hf = tiny_model("llama", dtype=torch.bfloat16)
    quantize_int4(hf, layout="int4pack")
    assert SelfSpecModel(hf, dtype_name="int4").adapter.step.fused is None  # PyTorch's int4 kernel
    hf = tiny_model("llama", dtype=torch.bfloat16)
    quantize_int4(hf, layout="blocks")
    assert SelfSpecModel(hf, dtype_name="int4").adapter.step.fused is not None  # selfspec's 4-bit blocks
    compiled = SelfSpecModel(tiny_model("llama"), lean=False)
    assert compiled.adapter.lean(compile=True, backend="eager").fused is None
    monkeypatch.setenv("SELFSPEC_FUSED", "0")
    assert SelfSpecModel(tiny_model("llama")).adapter.step.fused is None
    assert "SELFSPEC_FUSED=0" in fused_layer.unsupported_reason(SelfSpecModel(tiny_model("llama")).adapter.step)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3_text"])
@pytest.mark.parametrize("int8", [False, True])
def test_short_prefill_runs_as_fused_calls_of_16_where_bfloat16_is_emulated(arch, int8, monkeypatch):
    """A prompt of 17..PREFILL_CHUNKS tokens prefills as 16-row fused calls, one after another (each
    attending to the keys the ones before it wrote, past every tiny sliding window), where PyTorch's
    bfloat16 GEMM is emulated; its logits are PyTorch's prefill's within bfloat16 rounding, and every
    drafter still equals AR. Where bfloat16 is native, PyTorch's path keeps the prefill."""
    from selfspec.model import step

    model = _model(arch, torch.bfloat16, int8=int8)
    adapter = model.adapter
    calls = []
    real = adapter.step.fused.run
    monkeypatch.setattr(adapter.step.fused, "run", lambda h, *a, **k: calls.append(h.shape[1]) or real(h, *a, **k))
    monkeypatch.setattr(step, "PREFILL_CHUNKS", 40)
    ids = torch.randint(0, VOCAB, (37,), generator=torch.Generator().manual_seed(5))

    monkeypatch.setattr(gemv, "native_bfloat16", lambda: True)
    native = _logits(adapter, ids, 37)
    assert calls == []
    monkeypatch.setattr(gemv, "native_bfloat16", lambda: False)
    chunked = _logits(adapter, ids, 37)
    assert calls == [16, 16, 5]
    assert (chunked - native).abs().max() < 0.05 * native.abs().max()
    monkeypatch.setattr(step, "PREFILL_CHUNKS", 36)  # longer prompts keep PyTorch's path
    assert torch.equal(_logits(adapter, ids, 37), native) and calls == [16, 16, 5]

    monkeypatch.setattr(step, "PREFILL_CHUNKS", 40)
    prompt = ids.tolist()
    assert_greedy_lossless(model, prompt, n=24, method="early-exit", exit_layer=2, draft_len=3)
    assert_greedy_lossless(model, prompt, n=24, method="lookup", draft_len=3)
    assert calls[3:5] == [16, 16]  # the generations prefilled in chunks too


def _prefilled(adapter, prompts: list[torch.Tensor]) -> list:
    """A cache of 40 slots per prompt, each prompt prefilled into its own."""
    caches = [adapter.new_cache(40) for _ in prompts]
    with torch.inference_mode():
        for ids, cache in zip(prompts, caches):
            adapter.run_layers(adapter.embed(ids), range(adapter.n_layers), 0, cache)
    return caches


def _same_entries(caches, others, ends: list[int]) -> None:
    """Each cache's keys and values up to its end equal the other's, bit for bit."""
    for cache, other, end in zip(caches, others, ends):
        assert torch.equal(cache.keys[:, :, :, :end], other.keys[:, :, :, :end])
        assert torch.equal(cache.values[:, :, :, :end], other.values[:, :, :, :end])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "int4"])
@pytest.mark.parametrize("n", [4, 20])
def test_a_batched_verify_gives_each_row_its_lone_verifys_bits(dtype, n, path):
    """run_rows through the fused layer (several sequences' rows a call, kernels/layer.h layer_spans):
    every row's hidden state and every cache entry it writes equal the one-sequence forward's; more
    rows than one call takes run so while the model keeps prefixes (every forward rowwise). On every
    kernel path this CPU has (AVX2, AVX-512, the bfloat16 pairs)."""
    model = _quantized("qwen2", dtype)
    if n > fused_layer.ROWS:
        model.keep_prefixes(1 << 20)
    adapter = model.adapter
    prompts = [torch.randint(0, VOCAB, (k,), generator=torch.Generator().manual_seed(k)) for k in (9, 14, 11, 12, 10)]
    rows = torch.randint(0, VOCAB, (len(prompts), n), generator=torch.Generator().manual_seed(1))

    alone, together = _prefilled(adapter, prompts), _prefilled(adapter, prompts)
    with torch.inference_mode():
        lone = [adapter.run_layers(adapter.embed(r), range(adapter.n_layers), len(p), c, rowwise=True)
                for r, p, c in zip(rows, prompts, alone)]
        batched = adapter.run_rows(adapter.embed(rows.flatten()).view(len(prompts), n, -1), range(adapter.n_layers),
                                   [len(p) for p in prompts], together)  # 5 · 4 rows: two kernel calls
    for b in range(len(prompts)):
        assert torch.equal(batched[b], lone[b][0])
    _same_entries(together, alone, [len(p) + n for p in prompts])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "int4"])
@pytest.mark.parametrize("counts", [(1, 5, 3, 7), (4, 1, 1, 9, 2, 6, 1)])
def test_a_ragged_batched_verify_gives_each_row_its_lone_verifys_bits(dtype, counts, path):
    """run_ragged (sequences of different row counts sharing calls unpadded, kernels/layer.h
    layer_spans with each span's own row count): every row's hidden state and every cache entry it
    writes equal its sequence's one-sequence forward, whether a call holds one sequence or several
    (the second case: 24 rows, two calls)."""
    model = _quantized("qwen2", dtype)
    adapter = model.adapter
    assert adapter.ragged_rows(max(counts)) >= fused_layer.ROWS
    prompts = [torch.randint(0, VOCAB, (8 + b,), generator=torch.Generator().manual_seed(b)) for b in range(len(counts))]
    rows = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(50 + n + b)) for b, n in enumerate(counts)]

    alone, together = _prefilled(adapter, prompts), _prefilled(adapter, prompts)
    ops = []
    op = adapter.step.fused._rows_op
    adapter.step.fused._rows_op = lambda x, *args: ops.append(x.shape[0]) or op(x, *args)
    with torch.inference_mode():
        lone = [adapter.run_layers(adapter.embed(r), range(adapter.n_layers), len(p), c, rowwise=True)[0]
                for r, p, c in zip(rows, prompts, alone)]
        ragged = adapter.run_ragged(adapter.embed(torch.cat(rows))[0], range(adapter.n_layers),
                                    [len(p) for p in prompts], list(counts), together)
    groups = fused_layer.calls(list(counts), fused_layer.ROWS)  # one op call a layer for each
    assert ops == [sum(counts[b] for b in group) for group in groups for _ in range(adapter.n_layers)]
    assert torch.equal(ragged, torch.cat(lone))
    _same_entries(together, alone, [len(p) + n for p, n in zip(prompts, counts)])


def test_ragged_calls_fill_each_call_in_order():
    """fused_layer.calls: consecutive sequences while their rows fit, a longer one alone."""
    assert fused_layer.calls([1, 5, 3, 7], 16) == [[0, 1, 2, 3]]
    assert fused_layer.calls([4, 1, 1, 9, 2, 6, 1], 16) == [[0, 1, 2, 3], [4, 5, 6]]
    assert fused_layer.calls([3, 20, 2], 16) == [[0], [1], [2]]
    assert fused_layer.calls([16, 1], 16) == [[0], [1]]


@pytest.mark.parametrize("arch", ["qwen2", "gemma3_text"])
def test_a_4_bit_prefill_runs_row_by_row_where_its_products_run_tiles(arch, path):
    """With 4-bit weights whose products run many rows in tiles (AVX512-VNNI), a prefill of any
    length runs through the fused layer in calls of fused_layer.INT4_ROWS rows (300 tokens: two):
    every cache entry and the last hidden state are what one-token steps write, bit for bit. On
    the AVX2 build the prefill keeps PyTorch's path (its own rounding)."""
    model = _quantized(arch, "int4")
    adapter = model.adapter
    ids = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(5))
    calls = []
    run = adapter.step.fused.run
    adapter.step.fused.run = lambda h, *args, **kw: calls.append(h.shape[1]) or run(h, *args, **kw)
    with torch.inference_mode():
        whole, steps = adapter.new_cache(301), adapter.new_cache(301)
        h = adapter.run_layers(adapter.embed(ids), range(adapter.n_layers), 0, whole)
        tiled = adapter.step.fused.chunk > fused_layer.ROWS
        assert calls == ([fused_layer.INT4_ROWS, 300 - fused_layer.INT4_ROWS] if tiled else [])
        for t in range(300):
            last = adapter.run_layers(adapter.embed(ids[t:t + 1]), range(adapter.n_layers), t, steps, rowwise=True)
    if not tiled:
        return
    assert gemv.int4_vnni(gemv.kernel_path())
    assert torch.equal(h[0, -1], last[0, -1])
    assert torch.equal(whole.keys[:, :, :, :300], steps.keys[:, :, :, :300])
    assert torch.equal(whole.values[:, :, :, :300], steps.values[:, :, :, :300])


@pytest.mark.parametrize("dtype", [torch.bfloat16, "int4"])
def test_exact_mode_batches_verifies_each_row_as_alone(dtype, path, monkeypatch):
    """Exact mode shares one verify forward among requests where the fused layer and a row-invariant
    head run (ModelAdapter.batches_exactly): a scheduler's rows, batched up to 5 · 5 rows (the head
    in calls of 16), give every request plain decoding's greedy tokens."""
    from selfspec.core import batch

    monkeypatch.setattr(batch.Scheduler, "_choose", lambda self, rows, drafts, confidences=None: (  # every draft
        list(drafts), self._timer(rows)(list(drafts), parts=True)))
    model = _quantized("qwen2", dtype)
    model.exact = True
    model.adapter.lean(exact_rows=4)
    assert model.adapter.exact and model.adapter.batches_exactly(5)
    h = torch.randn(5, 5, model.adapter.lm_head.in_features, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.inference_mode():
        together = model.adapter.head_rows(h)  # 25 rows: two head calls
        for b in range(5):
            assert torch.equal(together[b], model.adapter.head(h[b:b + 1]))
    shared = []
    real = batch.verify_rows
    monkeypatch.setattr(batch, "verify_rows", lambda adapter, seqs, drafts: shared.append(len(seqs)) or real(adapter, seqs, drafts))
    prompts = [PROMPT, REPETITIVE, PROMPT[:5] + REPETITIVE[:7], REPETITIVE[3:], [11] * 12]
    alone = [model.generate(p, method="ar", max_new_tokens=20).tokens for p in prompts]
    batched = model.generate_batch(prompts, max_batch=5, max_new_tokens=20, method="lookup", draft_len=4)
    assert [g.tokens for g in batched] == alone
    assert shared and max(shared) == 5  # rows did share forwards
    assert sum(g.stats.accepted for g in batched) > 0
    plain = model.generate_batch(prompts, max_batch=5, max_new_tokens=20, method="ar")
    assert [g.tokens for g in plain] == alone
    # drafts of up to 12 beside rows in their last tokens, whose caches hold no padding: those verify alone
    shared.clear()
    runs = [model.prepare(p, fresh_drafter=True, max_new_tokens=n,
                          **(dict(method="lookup", draft_len=12) if i % 2 else dict(method="ar")))
            for i, (p, n) in enumerate(zip(prompts, (20, 3, 9, 20, 5)))]
    from test_batch import _run_all
    assert _run_all(model, runs, max_batch=5) == [model.generate(p, method="ar", max_new_tokens=n).tokens
                                                   for p, n in zip(prompts, (20, 3, 9, 20, 5))]
    assert shared
