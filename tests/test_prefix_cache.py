"""Prefix reuse (selfspec.model.prefix_cache): a prompt that starts with text an earlier generation
read prefills only the rest, and its output is bit for bit the one a store that never saw that text
gives, for any method; the store's matching, bound and refusals."""

import pytest
import torch

from selfspec.api import SelfSpecModel
from selfspec.core.engine import Decoding
from selfspec.core.sampling import SamplingParams
from selfspec.core.speculation import Speculation
from selfspec.core.stats import GenerationStats
from selfspec.drafters import make_drafter
from selfspec.model.cache import KVCache
from selfspec.model.prefix_cache import PrefixStore
from selfspec.native import gemv
from test_fused_layer import _quantized
from tiny_models import VOCAB

needs_fused = pytest.mark.skipif(not gemv.available(), reason="no g++ or no AVX2/FMA: no fused layer, no prefix reuse")


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _cache(length: int, capacity: int = 64, fill: float = 0.0) -> KVCache:
    cache = KVCache(2, 1, 4, capacity, dtype=torch.float32, device="cpu")
    cache.keys[:, :, :, :length] = fill + torch.arange(length, dtype=torch.float32).view(1, 1, 1, -1, 1)
    cache.values[:, :, :, :length] = -cache.keys[:, :, :, :length]
    cache.length = length
    return cache


def test_the_longest_stored_prefix_is_copied_and_never_the_prompts_last_token():
    store = PrefixStore(1 << 20, min_tokens=4)
    store.add(list(range(20)), _cache(20, fill=100.0))
    store.add(list(range(12)) + [99] * 8, _cache(20, fill=200.0))
    target = _cache(0)
    assert store.restore(torch.tensor(list(range(16)) + [7, 7]), target) == 16  # the first entry's 16 tokens
    assert torch.equal(target.keys[0, 0, 0, :16, 0], 100.0 + torch.arange(16.0))
    assert torch.equal(target.values[1, 0, 0, :16, 0], -(100.0 + torch.arange(16.0)))
    assert target.keys[0, 0, 0, 16:].abs().sum() == 0  # nothing past the match
    assert store.restore(torch.tensor(list(range(10))), _cache(0)) == 9  # the last token is prefilled
    assert store.restore(torch.tensor([5] + list(range(1, 20))), _cache(0)) == 0  # differs at the first token
    assert store.restore(torch.tensor(list(range(3)) + [50] * 5), _cache(0)) == 0  # under min_tokens
    assert (store.lookups, store.hits, store.reused_tokens) == (4, 2, 25)


def test_an_extended_entry_replaces_its_prefix_and_the_budget_drops_the_least_recently_used():
    one = _cache(10)
    per_entry = 2 * one.keys[:, 0, :, :10].numel() * 4  # keys and values of 10 positions, float32
    store = PrefixStore(2 * per_entry + per_entry // 2, min_tokens=4)
    store.add(list(range(8)), _cache(8))
    store.add(list(range(10)), _cache(10))  # extends the first: replaces it
    assert len(store) == 1
    store.add(list(range(6)), _cache(6))  # already held by the longer entry
    assert len(store) == 1
    store.add(list(range(100, 110)), _cache(10))
    store.restore(torch.tensor(list(range(10)) + [1]), _cache(0))  # the first entry is now the recent one
    store.add(list(range(200, 210)), _cache(10))  # over budget: the 100.. entry goes
    assert len(store) == 2 and store.nbytes <= store.budget_bytes
    assert store.restore(torch.tensor(list(range(100, 110)) + [1]), _cache(0)) == 0
    assert store.restore(torch.tensor(list(range(10)) + [1]), _cache(0)) == 10


def test_exit_states_travel_with_their_entries_and_an_entry_without_them_is_not_reused_for_them():
    source = _cache(10)
    source.keep_exit_states(2, 3)
    source.exit_states[:10] = torch.arange(30.0).view(10, 3)
    store = PrefixStore(1 << 20, min_tokens=4)
    store.add(list(range(10)), source)
    target = _cache(0)
    target.keep_exit_states(2, 3)
    assert store.restore(torch.tensor(list(range(12))), target) == 10
    assert torch.equal(target.exit_states[:10], source.exit_states[:10])
    other = _cache(0)
    other.keep_exit_states(1, 3)  # another layer's states: not these
    assert store.restore(torch.tensor(list(range(12))), other) == 0
    plain = PrefixStore(1 << 20, min_tokens=4)
    plain.add(list(range(10)), _cache(10))
    assert plain.restore(torch.tensor(list(range(12))), target) == 0


@needs_fused
@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("qwen2", torch.bfloat16), ("qwen2", "int4")])
@pytest.mark.parametrize("method", ["ar", "lookup", "suffix"])
def test_a_turn_that_reuses_the_last_ones_entries_gives_the_cold_output(arch, dtype, method):
    model = _quantized(arch, dtype)
    model.keep_prefixes(1 << 24)
    options = {"method": method, **({} if method == "ar" else {"draft_len": 3})}
    first = _ids(40, 1)  # longer than one fused call: the prefill runs in several
    answer = model.generate(first, max_new_tokens=12, **options)
    second = first + answer.tokens + _ids(21, 2)
    warm = model.generate(second, max_new_tokens=16, **options)
    reused = warm.stats.prefix_tokens
    assert reused >= len(first) + len(answer.tokens) - 1  # the whole first turn (its last token's entries too, but one)
    model.keep_prefixes(1 << 24)  # a fresh store: nothing to reuse
    cold = model.generate(second, max_new_tokens=16, **options)
    assert cold.stats.prefix_tokens == 0
    assert warm.tokens == cold.tokens
    model.keep_prefixes(1 << 24)
    assert model.generate(second, max_new_tokens=16, method="ar").tokens == cold.tokens  # lossless, as ever


@needs_fused
def test_the_kept_entries_are_the_ones_a_prefill_writes():
    """The cache a warm prefill leaves (reused entries, then the rest) is the cold prefill's, bit for bit."""
    model = _quantized("qwen2", "int4")
    model.keep_prefixes(1 << 24)
    adapter, store = model.adapter, model.prefix_store()
    ids = torch.tensor(_ids(50, 3))

    def prefilled(prompt):
        seq = Decoding(adapter, prompt, make_drafter(model.resolve(Speculation("ar"))), sampling=SamplingParams(),
                       max_new_tokens=4, stats=GenerationStats("ar"), prefix=store)
        seq.prefill()
        return seq

    seq = prefilled(ids[:30])
    seq.remember()
    warm = prefilled(ids)
    assert warm.stats.prefix_tokens == 30
    model.keep_prefixes(1 << 24)
    store = model.prefix_store()
    cold = prefilled(ids)
    assert torch.equal(warm.cache.keys[:, :, :, :50], cold.cache.keys[:, :, :, :50])
    assert torch.equal(warm.cache.values[:, :, :, :50], cold.cache.values[:, :, :, :50])


def test_where_reuse_would_not_be_exact_it_is_refused(tiny):
    model = tiny("llama")
    model.adapter.step.fused = None  # PyTorch's kernels: a prefill's rounding depends on its rows
    with pytest.raises(ValueError, match="cannot reuse prefixes exactly"):
        model.keep_prefixes(1 << 20)
    model.keep_prefixes(0)  # none kept: always allowed
    assert model.prefix_store() is None
    with pytest.raises(ValueError, match=">= 0"):
        model.keep_prefixes(-1)


@needs_fused
def test_the_server_reuses_a_conversations_turns_per_user_and_answers_as_a_cold_server():
    try:
        import httpx2 as httpx  # the HTTP library recent openai releases ship with
    except ImportError:
        import httpx

    from serving import Running, tiny_served

    turn1 = [{"role": "user", "content": " ".join(f"w{i % 50 + 5}" for i in range(40))}]

    def converse(running, user):
        client = running.client()
        ask = dict(model=running.name, max_tokens=8, temperature=0, user=user)
        first = client.chat.completions.create(messages=turn1, **ask).choices[0].message.content
        turn2 = turn1 + [{"role": "assistant", "content": first}, {"role": "user", "content": "w7 w8 w9"}]
        return client.chat.completions.create(messages=turn2, **ask).choices[0].message.content, turn2

    def reused(running):
        text = httpx.get(running.url + "/metrics").text
        return float(next(line.split()[-1] for line in text.splitlines()
                          if line.startswith("selfspec_prefix_reused_tokens_total ")))

    model = tiny_served()
    running = Running(model, suffix_scope="user", prefix_mb=16)
    try:
        answer, turn2 = converse(running, "a")
        after_a = reused(running)
        assert after_a >= 40  # the second turn read the first turn's prompt from the store
        assert "selfspec_prefix_store_bytes" in httpx.get(running.url + "/metrics").text
        client = running.client()
        other = client.chat.completions.create(model=running.name, messages=turn2, max_tokens=8, temperature=0, user="b")
        assert reused(running) == after_a  # user b's store never saw user a's text
        assert other.usage.prompt_tokens_details.cached_tokens == 0
        assert other.choices[0].message.content == answer
    finally:
        running.close()
    assert model.prefix_bytes == 0 and not model.adapter.step.rowwise_prefill  # the model as it was lent
    cold = Running(model, suffix_scope="user", prefix_mb=16)
    try:  # a fresh server's first request: the same answer, prefilled whole
        client = cold.client()
        again = client.chat.completions.create(model=cold.name, messages=turn2, max_tokens=8, temperature=0, user="a")
        assert reused(cold) == 0 and again.choices[0].message.content == answer
    finally:
        cold.close()


@needs_fused
def test_prefixes_are_kept_by_default_for_4_bit_models_only():
    from selfspec.serve.server import DEFAULT_PREFIX_MB, Server

    int4 = _quantized("qwen2", "int4")
    int4 = SelfSpecModel(int4.hf_model, dtype_name="int4")  # as selfspec.load(dtype="int4") names it
    assert Server(int4).prefix_bytes == int(DEFAULT_PREFIX_MB * 2**20)
    assert Server(_quantized("qwen2", torch.bfloat16)).prefix_bytes == 0  # measured not to pay in bfloat16
    assert Server(_quantized("qwen2", torch.bfloat16), prefix_mb=1).prefix_bytes == 1 << 20


@needs_fused
@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("qwen2", "int4")])
def test_batched_generations_keep_the_entries_a_prefill_would_write(arch, dtype):
    """A batched verify runs the sequences' rows through the fused layer together, each row's keys and
    values its lone verify's: a batched generation's whole answer is kept, the bits a prefill writes."""
    model = _quantized(arch, dtype)
    model.keep_prefixes(1 << 26)
    store = model.prefix_stores()[0]
    prompts = [_ids(30, 1), _ids(35, 2), _ids(33, 3)]
    model.generate_batch(prompts, max_new_tokens=20, method="lookup", draft_len=3)
    assert len(store) == 3 and all(e.tokens.numel() >= 40 for e in store._entries)  # prompts and answers
    for entry in store._entries:
        cold = Decoding(model.adapter, torch.cat([entry.tokens, entry.tokens[-1:]]),
                        make_drafter(model.resolve(Speculation("ar"))), sampling=SamplingParams(),
                        max_new_tokens=2, stats=GenerationStats("ar"))
        cold.prefill()
        length = entry.tokens.numel()
        assert torch.equal(cold.cache.keys[:, 0, :, :length], entry.keys)
        assert torch.equal(cold.cache.values[:, 0, :, :length], entry.values)


def test_tenants_share_one_budget_and_never_each_others_entries():
    store = PrefixStore(1 << 20, min_tokens=4)
    a, b = store.scoped("a"), store.scoped("b")
    a.add(list(range(20)), _cache(20))
    assert b.restore(torch.tensor(list(range(20))), _cache(0)) == 0  # b never reads a's text
    assert store.scoped(None).restore(torch.tensor(list(range(20))), _cache(0)) == 0
    assert a.restore(torch.tensor(list(range(20))), _cache(0)) == 19
    b.add(list(range(20)), _cache(20))  # the same tokens for b: its own entry
    assert len(store) == 2
    one = store.nbytes // 2
    small = PrefixStore(2 * one + one // 2, min_tokens=4)  # room for two entries over all tenants
    for i, tenant in enumerate("xyz"):
        small.scoped(tenant).add(list(range(100 * i, 100 * i + 20)), _cache(20))
    assert len(small) == 2 and small.nbytes <= small.budget_bytes  # x's, the oldest, went
    assert small.scoped("x").restore(torch.tensor(list(range(21))), _cache(0)) == 0
