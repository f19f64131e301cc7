"""What several subcommands share: the argparse class, the option groups (model, engine, sampling,
speculation, and advanced: the knobs of single drafter families), and the helpers that turn parsed
options into a model and a speculation, checked before the model loads."""

from __future__ import annotations

import argparse
import sys

from selfspec.core.speculation import OPTIONS, Speculation
from selfspec.drafters import METHODS
from selfspec.model.loading import BUNDLED, DEFAULT_MODEL


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and a pointer to --help, not the whole usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


def print_error(message: str) -> None:
    print(f"selfspec: error: {message}", file=sys.stderr)


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


MODEL_HELP = (
    f"bundled model name ({', '.join(BUNDLED)}; default {DEFAULT_MODEL}), a local Hugging Face checkpoint "
    "directory, or a .gguf file (converted once to safetensors in the cache)"
)


DTYPE_HELP = (
    "weights and activations dtype (default auto: int4 for the Qwen2.5-Coder models on x86 CPUs where selfspec's "
    "kernels build; else bfloat16 on CUDA, on x86 CPUs where selfspec's product kernel builds (AVX2 and g++) and on "
    "CPUs that compute it natively; else float32); int8: int8 weights with one scale per output channel, bfloat16 "
    "activations; int4 (CPU): 4-bit weights in groups of 32, each group's scale and minimum as 8-bit codes "
    "(llama.cpp's Q4_K idea, 4.6 bits a weight), activations as int8 in blocks of 32 for the products, an int8 "
    "head; lossless is relative to AR in the same dtype"
)
EXACT_HELP = (
    "greedy output bit-identical to AR by construction on any CPU or GPU: where selfspec's fused layer runs, each "
    "row's arithmetic is its own (drafts of any length); elsewhere every forward (AR step, draft, verify) runs one "
    "fixed 4-row bucket (drafts up to 3) (default: on for bfloat16 and int4, off for float32 and int8)"
)


def model_options(p: argparse.ArgumentParser, dtype: str | None = None, exact: str | None = None) -> None:
    """The "model" group (which model, on which device, in what dtype), then the "engine" group (how
    its forwards run); every subcommand but calc. dtype, exact: the help of those options where a
    subcommand's default differs. `generate` and `serve` list the engine after speculation instead."""
    model_group(p, dtype)
    engine_options(p, exact)


def model_group(p: argparse.ArgumentParser, dtype: str | None = None) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", "-m", default=None, help=MODEL_HELP)
    g.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default cpu)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "int8", "int4"],
                   help=dtype or DTYPE_HELP)
    g.add_argument("--head-dtype", default="int8", choices=["int8", "int4"],
                   help="an int4 model's LM head: int8 (default; llama.cpp's Q4_K_M keeps its output matrix at 6 "
                        "bits) or int4, 4-bit groups of 32 as its layers: Qwen2.5-Coder 1.5B's one-token step read "
                        "a sixth fewer bytes and took 0.88x the time (2-core AMD EPYC), and its greedy text matched "
                        "the int8 head's on 5 of 8 code prompts over 64 tokens (lossless still holds: every method "
                        "reproduces plain decoding with the same head)")


def engine_options(p: argparse.ArgumentParser, exact: str | None = None) -> None:
    g = p.add_argument_group("engine", "how the forwards run; the defaults suit the device")
    g.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads for torch's ops (default: $SELFSPEC_THREADS, else the cores no other process "
                        "is keeping busy, sampled for 0.15 s at start; a core another process holds stalls every "
                        "op at 2+ threads)")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the decode step with torch.compile, once per row bucket, cached on disk (default: "
                        "on where measured faster: CUDA; off on CPU)")
    g.add_argument("--exact", action=argparse.BooleanOptionalAction, default=None, help=exact or EXACT_HELP)
    g.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="where converted checkpoints live (default $SELFSPEC_CACHE, else $XDG_CACHE_HOME/selfspec, "
                        "else ~/.cache/selfspec)")


def sampling_options(p: argparse.ArgumentParser) -> None:
    """The "sampling" group: greedy by default; the same parameters the server's requests take."""
    g = p.add_argument_group("sampling", "greedy by default; the output follows the full model's distribution")
    g.add_argument("--temperature", "-t", type=float, default=0.0, metavar="T",
                   help="0 is greedy (default); > 0 samples")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens when sampling (0: off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass when sampling, in (0, 1] (1: off)")
    g.add_argument("--seed", type=int, default=None, help="seed for sampling, for repeatable output")


METHOD_HELP = (
    f"how the draft is made, one of: auto, {', '.join(METHODS)}. "
    "auto (default): what `selfspec tune` measured fastest for this model on this machine, else the choice shipped "
    "for it where that ran faster than plain decoding, else plain decoding; untuned, a note on stderr says which "
    "(bundled SmolLM2: hybrid on CPUs with AVX-512, AVX512-BF16 or AMX, or in int4; lookup on CUDA). "
    "hybrid: prompt lookup when the context's last tokens recur in it, else one token from the model's trained "
    "feature head (layer-skip when a skip set is given or tuned; early exit when -k is given or there is no head). "
    "lookup: copy from the prompt/output, no model. "
    "feature: a small trained head drafts from the last verify's final states, no model layers (EAGLE-style; "
    "shipped for SmolLM2, or made by `selfspec calibrate --head feature`). "
    "early-exit: layers < k. ar: no draft, the baseline. "
    "Research families (their knobs under advanced): layer-skip, a skip set from `selfspec search` (Draft & "
    "Verify); swift, a layer set searched during decoding; clasp, a layer set by dynamic programming per context; "
    "conflayers, confidence-adaptive skipping; expert-subset (mixture-of-experts models), each MoE layer routes a "
    "token to --experts experts instead of the model's top-k, all layers unless -k is given; saguaro, early exit "
    "that drafts the next round during each verify, for the outcome it expects (speculative speculative decoding)"
)

DRAFT_LEN_HELP = (
    "draft length γ, the most tokens drafted per round (adaptive methods may stop sooner). Default: with auto, "
    "the tuned or shipped γ (bundled SmolLM2 in bfloat16: hybrid, 3); else 3 in exact mode (the most its 4-row "
    "bucket holds); else early-exit, saguaro and expert-subset 4, feature 3, lookup, hybrid's lookup, "
    "layer-skip, clasp and conflayers 8, swift 25. hybrid's feature-head fallback always drafts 1"
)

DRAFT_VOCAB_HELP = (
    "early exit drafts with its head pruned to the N most frequent tokens (ranked by `selfspec calibrate` from "
    "the model's own outputs): a cheaper draft, output unchanged (the verify uses the full head); default: "
    "the full head"
)

ADVANCED = ("advanced", "knobs of single drafter families, most of them research methods that auto does not pick; "
                        "each defaults to its drafter's own value")


def speculation_options(p: argparse.ArgumentParser, description: str | None = None) -> None:
    """The "speculation" group: method, k and γ, what `generate` takes per run and `serve` as defaults;
    every other drafter knob is in `advanced_options`."""
    g = p.add_argument_group("speculation", description)
    g.add_argument("--method", default="auto", choices=["auto", *METHODS], metavar="METHOD", help=METHOD_HELP)
    g.add_argument("--exit-layer", "-k", type=int, default=None, metavar="K",
                   help="exit layer k: the draft runs layers 0..k-1 (early-exit, saguaro, expert-subset, hybrid's "
                        "early-exit fallback); default: the tuned profile's, else the k of the profile's exit adapter "
                        "or context head, else 3/4 of the model's depth (expert-subset: every layer). With auto and no "
                        "tuned profile, -k or -g asks for early exit")
    g.add_argument("--draft-len", "-g", type=int, default=None, metavar="G", help=DRAFT_LEN_HELP)


def advanced_options(p: argparse.ArgumentParser) -> None:
    """The "advanced" group: the knobs of single drafter families."""
    g = p.add_argument_group(*ADVANCED)
    g.add_argument("--threshold", type=float, default=None,
                   help="confidence stop: end a draft after a token whose draft top-1 probability is below this "
                        "(default: feature 0.3; swift, clasp and conflayers 0.8, and layer-skip's adaptive threshold "
                        "starts there; early exit: 0.6 with a context head, else no stop)")
    g.add_argument("--ngram", type=int, default=None,
                   help="lookup/hybrid: longest n-gram to match (default 3; hybrid with the feature head matches "
                        "2 or more)")
    g.add_argument("--siblings", type=int, default=None, metavar="M",
                   help="feature head (and hybrid's fallback to it): draft its M likeliest next tokens as "
                        "alternatives, all verified in one forward, instead of a chain (default: 1, a chain; "
                        "hybrid 2 on CPUs with AMX, where a few rows cost about one)")
    g.add_argument("--skip", default=None,
                   help="layer-skip's sublayers to skip, e.g. 'attn:3,5 mlp:10-14' or '10-19' (whole layers); "
                        "default: the model's profile from `selfspec search`")
    g.add_argument("--skip-ratio", type=float, default=None,
                   help="share of layers/sublayers swift, clasp and conflayers skip (default per method)")
    g.add_argument("--every", type=int, default=None,
                   help="rounds between clasp/conflayers re-optimisations; swift: iterations between "
                        "Bayesian proposals (default per method)")
    g.add_argument("--exit-adapter", default=None, metavar="FILE|none",
                   help="early exit's trained exit adapter or context head (a .safetensors file from `selfspec "
                        "calibrate [--head context]`), or 'none' for plain early exit; default: the profile's context "
                        "head, else its adapter, when its k is the one asked (without -k, its k becomes the default)")
    g.add_argument("--draft-vocab", type=int, default=None, metavar="N", help=DRAFT_VOCAB_HELP)
    g.add_argument("--experts", type=int, default=None, metavar="N",
                   help="expert-subset: routed experts per token in each mixture-of-experts layer of the draft, "
                        "1 .. the model's top-k (default 1); the verify uses the model's own routing")
    g.add_argument("--profile", default=None,
                   help="a profile JSON file to use instead of this model's saved one (must match the model)")


def speculation(args) -> Speculation:
    """The speculation `speculation_options` and `advanced_options` describe, checked (values, and
    that each option given is one its method takes) before the model loads."""
    return Speculation.from_options(args.method, **{name: getattr(args, name) for name in OPTIONS})


def load(args, **overrides):
    """The model named by the shared model options (`model_options`); `overrides` win."""
    import selfspec

    options = dict(dtype=args.dtype, device=args.device, compile=args.compile, exact=args.exact,
                   head=getattr(args, "head_dtype", "int8"))
    return selfspec.load(args.model, **{**options, **overrides})


def check_model_options(args, spec: Speculation) -> None:
    """Checks that need the model's shape or the engine mode, before the model loads: the
    speculation against the layer count in the config on disk, and exact mode's draft-length limit."""
    from selfspec.api import check_exact_draft, default_dtype, default_exact, exact_limit_here
    from selfspec.model.loading import peek_layers

    n_layers = peek_layers(args.model, args.cache_dir)
    if n_layers is not None:
        spec.validate(n_layers)
    dtype = default_dtype(args.device, args.model) if args.dtype == "auto" else args.dtype
    exact = default_exact(dtype) if args.exact is None else args.exact
    if exact and spec.draft_len is not None:
        check_exact_draft(spec.draft_len, exact_limit_here())  # the model's own limit is checked once loaded


def check_options(options: dict) -> None:
    """Cheap checks of the sampling options and --max-new-tokens before the (slow) model load."""
    from selfspec.core.sampling import SamplingParams

    if "temperature" in options:
        SamplingParams(temperature=options["temperature"], top_k=options["top_k"], top_p=options["top_p"])
    if options.get("max_new_tokens", 1) < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {options['max_new_tokens']}")


def comma_ints(entries: list[str] | None) -> list[int]:
    """Values of a repeatable, comma-separated integer option (-k 4,8 -k 12): [4, 8, 12]."""
    return [int(k) for entry in (entries or []) for k in entry.split(",") if k.strip()]
