"""transformers' own generate() as the references users would otherwise pick: greedy AR, its
LayerSkip-style early exit (`assistant_early_exit=k`) and prompt lookup decoding
(`prompt_lookup_num_tokens`). Their assisted rounds are counted through transformers' own
feedback hook, so α and accepted length are real counts; its rounds include the first forward,
which also prefills the prompt.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from selfspec.core.stats import GenerationStats

HF_LOOKUP_TOKENS = 10  # prompt lookup's γ when no -g is given: the value transformers' docs use
# transformers reads these from the assistant model's own generation_config, not from generate()'s
# arguments; for early exit the assistant is the model itself.
ASSISTANT_SETTINGS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")




def reference_configs(exit_layer: int, draft_len: int | None) -> list[tuple[str, dict]]:
    """(label, generate() arguments) of each reference. γ, when given, is drafted in full every
    round (constant schedule, no confidence stop) as ours is; without it early exit keeps
    transformers' own γ and confidence stop, and prompt lookup drafts HF_LOOKUP_TOKENS."""
    early_exit = {"assistant_early_exit": exit_layer}
    if draft_len is not None:
        early_exit.update(num_assistant_tokens=draft_len, num_assistant_tokens_schedule="constant",
                          assistant_confidence_threshold=0.0)
    lookup = draft_len or HF_LOOKUP_TOKENS
    gamma = f"γ={draft_len}" if draft_len else "(its default γ, confidence stop)"
    return [
        ("transformers generate()", {}),
        (f"transformers early exit k={exit_layer} {gamma}", early_exit),
        (f"transformers prompt lookup γ={lookup}", {"prompt_lookup_num_tokens": lookup}),
    ]


@torch.inference_mode()
def hf_generate(model, ids: torch.Tensor, n: int, kwargs: dict) -> tuple[list[int], float, GenerationStats | None, int]:
    """transformers' greedy generate() with extra arguments `kwargs` (none: plain AR): (tokens
    without EOS, seconds, the assisted rounds' statistics or None, bytes of every KV cache held)."""
    hf = model.hf_model
    eos = sorted(model.eos_ids)
    inputs = ids.view(1, -1).to(model.adapter.device)
    settings = {key: value for key, value in kwargs.items() if key in ASSISTANT_SETTINGS}
    arguments = {key: value for key, value in kwargs.items() if key not in ASSISTANT_SETTINGS}
    stats = GenerationStats("hf", kwargs.get("assistant_early_exit"))
    with _observed_assistance(hf, settings, stats) as drafters:
        t = time.perf_counter()
        out = hf.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=False, max_new_tokens=n,
                          eos_token_id=eos or None, pad_token_id=eos[0] if eos else None,
                          return_dict_in_generate=True, **arguments)
        if inputs.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t
    tokens = out.sequences[0, inputs.shape[1]:].tolist()
    for i, token in enumerate(tokens):
        if token in model.eos_ids:
            tokens = tokens[:i]
            break
    # Early exit's drafter keeps a second cache for the draft's layers; it counts too.
    caches = [_cache_in(out)] + [_cache_in(getattr(d, "assistant_kwargs", {})) for d in drafters]
    kv_bytes = sum(hf_cache_bytes(c) for c in caches)
    if not stats.rounds:
        return tokens, seconds, None, kv_bytes
    stats.prompt_tokens, stats.new_tokens, stats.wall_s = inputs.shape[1], len(tokens), seconds
    return tokens, seconds, stats, kv_bytes


@contextmanager
def _observed_assistance(hf, settings: dict, stats: GenerationStats) -> Iterator[list]:
    """For one generate() call: apply `settings` to a copy of the model's generation_config, where
    transformers' early exit reads γ from, and record every assisted round in `stats` through
    transformers' own feedback hook, update_candidate_strategy(input_ids, scores [1, drafted + 1,
    vocab], n_matches). Yields the candidate generators made. Both changes end with the block; where
    transformers has no such hook, the rounds go uncounted (α "–") rather than the method failing."""
    made = []
    make = getattr(hf, "_get_candidate_generator", None)

    def make_observed(*args, **kwargs):
        drafter = make(*args, **kwargs)
        update = drafter.update_candidate_strategy

        def observe(input_ids, scores, num_matches):
            stats.record_round(scores.shape[1] - 1, int(num_matches))
            return update(input_ids, scores, num_matches)

        drafter.update_candidate_strategy = observe
        # γ as the drafter holds it: early exit's num_assistant_tokens, prompt lookup's num_output_tokens
        gamma = getattr(drafter, "num_assistant_tokens", None) or getattr(drafter, "num_output_tokens", 0)
        stats.draft_len = int(gamma)
        made.append(drafter)
        return drafter

    config = hf.generation_config
    if settings:
        hf.generation_config = copy.deepcopy(config)
        hf.generation_config.update(**settings)
    if make is not None:
        hf._get_candidate_generator = make_observed  # shadows the method on this instance only
    try:
        yield made
    finally:
        if make is not None:
            del hf._get_candidate_generator
        hf.generation_config = config


def _cache_in(holder) -> object | None:
    """The Cache in generate()'s output or a drafter's kwargs; later transformers 5 releases renamed
    past_key_values to cache."""
    return next((holder[name] for name in ("cache", "past_key_values") if holder.get(name) is not None), None)


def hf_cache_bytes(cache) -> int:
    """Bytes of the keys and values a transformers Cache holds, over its layers."""
    if cache is None:
        return 0
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if isinstance(t, torch.Tensor))
