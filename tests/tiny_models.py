"""Tiny random-initialised decoders of every supported architecture, for fast lossless tests."""

import torch
from transformers import (
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    AutoModelForCausalLM,
)

VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


def _configs():
    return {
        "llama": LlamaConfig(**COMMON),
        "mistral": MistralConfig(**COMMON, sliding_window=7),
        "qwen2": Qwen2Config(
            **COMMON, use_sliding_window=True, sliding_window=5, max_window_layers=3,
            layer_types=["full_attention"] * 3 + ["sliding_attention"] * 3,
        ),
        "qwen3": Qwen3Config(**COMMON, head_dim=16),
        "phi3": Phi3Config(**COMMON, pad_token_id=0, partial_rotary_factor=0.5),
        "gemma3_text": Gemma3TextConfig(
            **{**COMMON, "tie_word_embeddings": True}, head_dim=16, sliding_window=6,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            final_logit_softcapping=30.0,
        ),
    }


ARCHS = list(_configs())


def tiny_model(arch: str, seed: int = 0, dtype=torch.float32):
    """A random model whose logits are peaked enough that greedy has no near-ties."""
    return build(_configs()[arch], seed, dtype)


def tiny_tokenizer(chat_template: str | None = None):
    """Token i is the word w<i>: text in, the tiny model's ids out (and a chat template, if given)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0")
    tokenizer.chat_template = chat_template
    return tokenizer


def tiny_checkpoint_with_prompts(directory, prompts: int = 4):
    """A tiny llama checkpoint with its tokenizer saved under `directory`, and a JSONL file of
    `prompts` random 6-word prompts beside it (what `selfspec calibrate` takes): (checkpoint, prompts)."""
    import json
    import random

    ckpt = directory / "tiny"
    tiny_model("llama").save_pretrained(ckpt)
    tiny_tokenizer().save_pretrained(ckpt)
    rng = random.Random(0)
    path = directory / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": " ".join(f"w{rng.randrange(3, VOCAB)}" for _ in range(6))}) + "\n"
                            for _ in range(prompts)))
    return ckpt, path


def build(config, seed: int = 0, dtype=torch.float32):
    """The model of `config` with random weights drawn as tiny_model's are."""
    config.eos_token_id = None
    config.bos_token_id = None
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.25 if "embed" in name or "lm_head" in name else 0.08)
    return model.eval().requires_grad_(False)
