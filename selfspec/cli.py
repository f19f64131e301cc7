"""The `selfspec` command: one entry point, subcommands `generate`, `serve`, `tune`, `search`, `calibrate`,
`train`, `bench` and `calc`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from selfspec.drafters import METHODS
from selfspec.model.loading import BUNDLED, DEFAULT_MODEL

MODEL_HELP = (
    f"bundled model name ({', '.join(BUNDLED)}; default {DEFAULT_MODEL}), a local Hugging Face checkpoint "
    "directory, or a .gguf file (converted once to safetensors in the cache)"
)


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None, help=MODEL_HELP)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "int8", "int4"],
                   help="weights and activations dtype (default auto: bfloat16 on CUDA and where selfspec's product "
                        "kernel runs (x86 with AVX2 and g++) or the CPU computes it natively; else float32); "
                        "int8: int8 weights (the head too) with one scale per output channel and bfloat16 activations; int4 (CPU): 4-bit weights in groups of 32 (the GGUF Q4_1 grid), "
                        "an int8 head, bfloat16 activations; lossless is relative to AR in the same dtype")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the decode step with torch.compile, once per row bucket, cached on disk (default: "
                        "on where measured faster: CUDA; off on CPU)")
    p.add_argument("--exact", action=argparse.BooleanOptionalAction, default=None,
                   help="run every forward (AR step, draft, verify) in one fixed 4-row bucket, so that greedy output "
                        "is bit-identical to AR by construction on any CPU or GPU (draft length <= 3; default: on for "
                        "bfloat16 and int4, off for float32 and int8)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default cpu)")
    p.add_argument("--cache-dir", default=None,
                   help="where converted checkpoints live (default $SELFSPEC_CACHE, else $XDG_CACHE_HOME/selfspec, "
                        "else ~/.cache/selfspec)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads for torch's ops (default: $SELFSPEC_THREADS, else the cores no other process "
                        "is keeping busy, sampled for 0.15 s at start; a core another process holds stalls every "
                        "op at 2+ threads)")


METHOD_HELP = (
    "how the draft is made: auto (default: what `selfspec tune` chose for this model, else the choice shipped for "
    "it, else plain decoding), "
    "early-exit (layers < k), layer-skip (a skip set found by "
    "`selfspec search`, Draft & Verify), swift (layer set searched during decoding), clasp (layer set by "
    "dynamic programming per context), conflayers (confidence-adaptive skipping), lookup (copy from the "
    "prompt/output, no model), hybrid (lookup when it matches, else early exit), expert-subset (mixture-of-experts "
    "models: each MoE layer routes a token to --experts experts instead of the model's top-k; all layers unless "
    "-k is given), saguaro (early exit that drafts the next round during each verify, for the outcome it "
    "expects: speculative speculative decoding), feature (no model layers: a small trained head drafts from the last "
    "verify's final states, EAGLE-style; shipped for SmolLM2, or made by `selfspec calibrate --head feature`), "
    "ar (no draft; the baseline)"
)


def _speculation_options(p: argparse.ArgumentParser) -> None:
    """The method, k, γ and every drafter knob: what `generate` takes per run and `serve` as defaults."""
    p.add_argument("--method", default="auto", choices=["auto", *METHODS], help=METHOD_HELP)
    p.add_argument("--exit-layer", "-k", type=int, default=None,
                   help="exit layer k: the draft runs layers 0..k-1 (default: the tuned profile's, else 3/4 of the "
                        "model's depth)")
    p.add_argument("--draft-len", "-g", type=int, default=None,
                   help="draft length γ, tokens per round; the cap for adaptive methods (default: early-exit 4, "
                        "layer-skip 8, swift 25, others per method)")
    _drafter_options(p)


def _drafter_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--siblings", type=int, default=None, metavar="M",
                   help="feature head (and hybrid's fallback to it): draft its M likeliest next tokens as "
                        "alternatives, all verified in one forward, instead of a chain (default: 1, a chain; "
                        "hybrid 2 on CPUs with AMX, where a few rows cost about one)")
    p.add_argument("--threshold", type=float, default=None,
                   help="confidence stop: end a draft after a token whose draft top-1 probability is below this "
                        "(layer-skip: the starting value of its adaptive threshold; default per method, 0.8; "
                        "early exit: 0.6 with a context head, else no stop)")
    p.add_argument("--skip", default=None,
                   help="layer-skip's sublayers to skip, e.g. 'attn:3,5 mlp:10-14' or '10-19' (whole layers); "
                        "default: the model's profile from `selfspec search`")
    p.add_argument("--skip-ratio", type=float, default=None,
                   help="share of layers/sublayers swift, clasp and conflayers skip (default per method)")
    p.add_argument("--every", type=int, default=None,
                   help="rounds between clasp/conflayers re-optimisations; swift: iterations between "
                        "Bayesian proposals (default per method)")
    p.add_argument("--ngram", type=int, default=None, help="lookup/hybrid: longest n-gram to match (default 3)")
    p.add_argument("--profile", default=None,
                   help="a profile JSON file to use instead of this model's saved one (must match the model)")
    p.add_argument("--exit-adapter", default=None, metavar="FILE|none",
                   help="early exit's trained exit adapter or context head (a .safetensors file from `selfspec "
                        "calibrate [--head context]`), or 'none' for plain early exit; default: the profile's context "
                        "head, else its adapter, when its k is the one asked (without -k, its k becomes the default)")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N", help=DRAFT_VOCAB_HELP)
    p.add_argument("--experts", type=int, default=None, metavar="N",
                   help="expert-subset: routed experts per token in each mixture-of-experts layer of the draft, "
                        "1 .. the model's top-k (default 1); the verify uses the model's own routing")


DRAFT_VOCAB_HELP = (
    "early exit drafts with its head pruned to the N most frequent tokens (ranked by `selfspec calibrate` from "
    "the model's own outputs): a cheaper draft, output unchanged (the verify uses the full head); default: "
    "the full head"
)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and a pointer to --help, not the whole usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="selfspec",
        description="Lossless self-speculative decoding: the model drafts with its first k layers and "
                    "verifies with one full forward on a shared KV cache. Output equals the full model's.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a completion, streaming it, then print statistics",
                       description="Generate a completion. The text streams to stdout; one line of statistics "
                                   "(tokens, tokens/s, α, accepted tokens per step, k, γ, c) follows on stderr.")
    g.add_argument("prompt", nargs="?", default=None, help="prompt text; '-' or nothing reads standard input")
    _model_options(g)
    _speculation_options(g)
    g.add_argument("--max-new-tokens", "-n", type=int, default=128, help="most tokens to generate (default 128)")
    g.add_argument("--temperature", "-t", type=float, default=0.0, help="0 is greedy (default); > 0 samples")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens when sampling (0: off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass when sampling, in (0, 1] (1: off)")
    g.add_argument("--seed", type=int, default=None, help="seed for sampling, for repeatable output")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable); not included in the output")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the model's chat template (default: when the model has one)")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, statistics) instead")

    sv = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server; concurrent requests are decoded together in one batch",
        description="Serve the model over HTTP with the OpenAI API: POST /v1/chat/completions and /v1/completions "
                    "(stream: true for server-sent events), GET /v1/models, /health and /metrics (Prometheus). "
                    "Concurrent requests share each verify forward (continuous batching); every request's output "
                    "is what it would be alone. Requests may choose speculation under the extension key "
                    "'selfspec' (method, exit_layer, draft_len, threshold, ngram); the flags below are the "
                    "server's defaults.")
    _model_options(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    sv.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    sv.add_argument("--api-key", default=os.environ.get("SELFSPEC_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on every route but /health (default: "
                         "$SELFSPEC_API_KEY; unset: no key)")
    sv.add_argument("--name", default=None, help="model name clients must send (default: the model's name)")
    sv.add_argument("--max-batch", type=int, default=8, help="requests decoded together (default 8)")
    sv.add_argument("--max-queue", type=int, default=32,
                    help="requests waiting for a free row before the server answers 503 (default 32)")
    sv.add_argument("--max-request-seconds", type=float, default=600,
                    help="wall time from a request's arrival after which it ends with finish_reason 'length' "
                         "and frees its row (default 600; 0: no limit)")
    sv.add_argument("--stall-seconds", type=float, default=120,
                    help="GET /health answers 503 when requests are being decoded and no decoding step has ended "
                         "for this long (default 120); if the decoding loop dies the server exits with status 1")
    sv.add_argument("--drain-seconds", type=float, default=5,
                    help="on SIGTERM or Ctrl-C, seconds that active requests may run on before they are "
                         "cancelled and the server exits (default 5)")
    rs = sv.add_argument_group("replicas on Ray Serve", 'several copies of the server behind one endpoint; '
                               'needs pip install "selfspec[ray]"')
    rs.add_argument("--replicas", type=int, default=None, metavar="N",
                    help="run N replicas, each with its own model, scheduler and speculation, on a local Ray "
                         "instance (default: one process, no Ray)")
    rs.add_argument("--autoscale", default=None, metavar="MIN:MAX",
                    help="let Ray Serve scale the replicas between MIN and MAX on ongoing requests (a replica "
                         "counts as busy from 2; --replicas is then the initial count)")
    rs.add_argument("--ray-address", default=None, metavar="ADDR",
                    help="join this Ray cluster (e.g. HEAD_IP:6379 from 'ray start --head') instead of "
                         "starting a local instance; replicas then run on any of its machines")
    rs.add_argument("--replica-cpus", type=float, default=1, metavar="C",
                    help="CPUs each replica reserves, and its torch threads (default 1)")
    _speculation_options(sv)

    s = sub.add_parser("search", help="find the layer-skip set for this model (Bayesian optimisation)",
                       description="Search, offline, which attention and MLP sublayers the layer-skip draft should "
                                   "skip: Bayesian optimisation of measured tokens/s on calibration prompts (Draft & "
                                   "Verify). Saves the best set to the model's profile, which `generate --method "
                                   "layer-skip` and `bench` then use.")
    _model_options(s)
    s.add_argument("--prompts", default=None,
                   help="calibration prompts: JSONL (turns or prompt per row) or text (one per line); default: the "
                        "bundled calibration set (Spec-Bench questions not in the benchmark subset); 'code': the "
                        "bundled held-out code prompts")
    s.add_argument("--num-prompts", type=int, default=2, help="calibration prompts to use (default 2)")
    s.add_argument("--max-new-tokens", "-n", type=int, default=32, help="tokens per prompt per trial (default 32)")
    s.add_argument("--iterations", type=int, default=40, help="skip sets to measure (default 40; ~10 s each here)")
    s.add_argument("--draft-len", "-g", type=int, default=8, help="the most draft tokens per round (default 8)")
    s.add_argument("--threshold", type=float, default=0.8, help="initial adaptive stop threshold (default 0.8)")
    s.add_argument("--seed", type=int, default=0, help="seed of the optimiser (default 0)")
    s.add_argument("--output", default=None, help="profile file to write (default: the model's profile in the cache)")
    s.add_argument("--json", action="store_true", help="print the result as JSON")

    b = sub.add_parser("bench", help="benchmark AR, the drafters and transformers generate() on Spec-Bench prompts",
                       description="Run our AR, the chosen drafters and transformers' own greedy generate() (AR, "
                                   "its early exit at the first k and its prompt lookup, both at the first γ) on the "
                                   "same prompts in one process; print tokens/s, α, mean accepted length, c, speedups, "
                                   "peak memory and KV cache size per method and per category, and check every "
                                   "output against our AR.")
    _model_options(b)
    b.add_argument("--method", action="append", default=None,
                   help="drafter(s) to run, repeatable or comma-separated, or 'all' (default early-exit, with k "
                        "and γ from `selfspec tune` when it chose early exit); auto: the tuned choice; "
                        f"from: {', '.join(m for m in METHODS if m != 'ar')}")
    b.add_argument("--prompts", default=None,
                   help="Spec-Bench style JSONL (question_id, category, turns); default: the bundled subset "
                        "(first 5 per category group); 'code': the bundled code prompts (function stubs and "
                        "coding tasks, 4 per category)")
    b.add_argument("--per-category", type=int, default=1, help="first N prompts of each category (default 1)")
    b.add_argument("--max-new-tokens", "-n", type=int, default=64, help="tokens per prompt (default 64)")
    b.add_argument("--exit-layer", "-k", type=int, action="append", default=None,
                   help="exit layer(s) to run, repeatable (default: 3/4 of depth)")
    b.add_argument("--draft-len", "-g", type=int, action="append", default=None,
                   help="draft length(s) to run, repeatable (default 4)")
    b.add_argument("--draft-vocab", type=int, default=None, metavar="N", help=DRAFT_VOCAB_HELP)
    b.add_argument("--siblings", type=int, default=None, metavar="M",
                   help="feature and hybrid: the head's M likeliest next tokens as alternatives verified in one "
                        "forward (default: feature 1; hybrid 2 on CPUs with AMX, else 1)")
    b.add_argument("--experts", type=int, action="append", default=None, metavar="N",
                   help="expert-subset's routed experts per token per MoE layer, repeatable (default 1; "
                        "mixture-of-experts models only, which `--method all` then includes)")
    b.add_argument("--llamacpp", action="store_true",
                   help="add llama.cpp's plain greedy decoding of the same GGUF at the same thread count (needs "
                        "llama-cpp-python, which builds from source: ~8 minutes on 2 cores)")
    b.add_argument("--no-hf", action="store_true",
                   help="skip the transformers generate() references (AR, early exit, prompt lookup)")
    b.add_argument("--temperature", "-t", type=float, default=0.0,
                   help="sample at this temperature instead of greedy decoding (default 0: greedy); every method "
                        "then draws with the same seed per prompt, the transformers references are left out, and "
                        "the '= AR' column reads 'sampled'")
    b.add_argument("--seed", type=int, default=0, help="sampling seed of the first prompt; prompt i uses seed + i")
    b.add_argument("--repeats", type=int, default=1, metavar="R",
                   help="run the prompts R times over, every method on each prompt in turn, and sum (default 1); "
                        "on a noisy or shared machine 2-3 rounds spread its drift over all methods")
    b.add_argument("--json", dest="json_out", default=None, help="also write the results as JSON to this file")
    b.add_argument("--markdown", default=None, help="also write the results table as markdown to this file")
    c = sub.add_parser("calc", help="the analytic model: tokens per step, speedup, ceiling, best γ",
                       description="Expected tokens per step (1 - α^(γ+1)) / (1 - α), speedup = that / (γ·c + v) "
                                   "and the ceiling 1 / (1 - α), for every combination of the given values, and the "
                                   "best γ for each α, c, v. Values: a number, a comma list, or start:stop:step.")
    c.add_argument("--alpha", "-a", default="0.5:0.9:0.1", help="acceptance rate(s) α in [0, 1] (default 0.5:0.9:0.1)")
    c.add_argument("--draft-len", "-g", default="1,2,4,8", help="draft length(s) γ (default 1,2,4,8)")
    c.add_argument("--cost", "-c", default="0.25", help="draft cost(s) c, one draft token over one full forward "
                                                         "(default 0.25)")
    c.add_argument("--verify", "-v", default="1", help="verify cost(s) v, a verify over γ+1 positions over one "
                                                        "full one-token forward (default 1, the standard model)")
    cal = sub.add_parser(
        "calibrate", help="train a tiny exit adapter per exit layer so early exit drafts better (model frozen)",
        description="Generate the model's own greedy continuations of calibration prompts, teacher-force them "
                    "(plus any --text), and train for each exit layer k a small residual MLP that maps the "
                    "layer-k hidden state to the model's final one, by distillation (KL to the full model's "
                    "next-token distribution). The base model is frozen; the verify is unchanged, so output "
                    "stays the full model's. Reports α (agreement with the full model's next token, = first "
                    "draft token acceptance) on held-out prompts before and after, saves one .safetensors per k "
                    "and points the model's profile at the best, which generate, bench and the server then use. "
                    "Also ranks the tokens of the prompts and outputs by frequency, for --draft-vocab.")
    _model_options(cal)
    cal.add_argument("--prompts", default=None,
                     help="JSONL (Spec-Bench style: turns or prompt per row) or text (one prompt per line); default: "
                          "the bundled training set (Spec-Bench questions outside the benchmark and tune sets); "
                          "'code': the bundled held-out code prompts")
    cal.add_argument("--num-prompts", type=int, default=120, help="first N prompts of the file (default 120)")
    cal.add_argument("--text", action="append", default=[], metavar="FILE",
                     help="plain text to train on as well, in windows of 256 tokens (--head feature: 512, teacher-forced "
                          "with no decoding) (repeatable; training only, never held out)")
    cal.add_argument("--extra-prompts", default=None, metavar="FILE",
                     help="--head feature: more prompts (JSONL or text, like --prompts), decoded and trained on like "
                          "them but never held out, so α is measured on the same held-out split as without them "
                          "(e.g. scripts/synthetic_prompts.py's output)")
    cal.add_argument("--max-new-tokens", "-n", type=int, default=128,
                     help="tokens generated per prompt (default 128)")
    cal.add_argument("--exit-layer", "-k", type=int, action="append", default=None,
                     help="exit layer(s) to train, repeatable (default: 1/3 and 1/2 of the depth)")
    cal.add_argument("--steps", type=int, default=None,
                     help="optimiser steps per exit layer (default 500, --head feature 2000; about 0.35 s each "
                          "for SmolLM2 on 2 idle CPU cores)")
    cal.add_argument("--batch-size", type=int, default=256,
                     help="positions per step (default 256); --head context: positions the loss is taken at, "
                          "drawn from --sequences whole sequences")
    cal.add_argument("--lr", type=float, default=3e-3, help="AdamW peak learning rate (default 3e-3)")
    cal.add_argument("--width", type=int, default=None,
                     help="adapter hidden width (default: the model's hidden size; parameters ≈ 2·hidden·width)")
    cal.add_argument("--holdout", type=float, default=0.1,
                     help="share of prompts held out for α, in (0, 1) (default 0.1)")
    cal.add_argument("--seed", type=int, default=0, help="seed of the split, initialisation and batches (default 0)")
    cal.add_argument("--output", default=None,
                     help="directory for the adapter files (default: beside the model's profile)")
    cal.add_argument("--generate-batch", type=int, default=32,
                     help="prompts generated together when making the data (default 32)")
    cal.add_argument("--head", choices=("mlp", "context", "feature"), default="mlp",
                     help="what to train: 'mlp', the per-position exit adapter (default), or 'context', the "
                          "context head (Kangaroo-style: one small attention block over the context's exit states, "
                          "then the MLP; drafts stop early below --threshold 0.6 unless told otherwise); the "
                          "profile then points early exit at that k at it; or 'feature', the feature head "
                          "(EAGLE-style: drafts from the last verify's final states with no model layers; "
                          "--method feature; data from the engine's own greedy decoding, --train-vocab default 8192, "
                          "--steps default 2000)")
    cal.add_argument("--heads", type=int, default=4,
                     help="--head context: attention heads of 64 dimensions (default 4)")
    cal.add_argument("--sequences", type=int, default=8,
                     help="--head context: whole sequences per step, their every position context (default 8)")
    cal.add_argument("--train-vocab", type=int, default=None, metavar="N",
                     help="--head context: train against a head pruned to the N most frequent tokens of the data, "
                          "as --draft-vocab N drafts (default: the full head, or 32768 when the vocabulary has "
                          "more than 100k tokens, e.g. Gemma 3's 262k)")
    cal.add_argument("--samples", type=int, default=0,
                     help="--head feature: sampled continuations per prompt besides the greedy one, more training "
                          "text at the cost of more decoding (default 0)")
    cal.add_argument("--noise", type=float, default=0.0,
                     help="--head feature: Gaussian noise (in RMS units) on the previous-state inputs in training "
                          "(default 0)")
    cal.add_argument("--data", default=None, metavar="FILE",
                     help="--head feature: keep the decoded training data in FILE and reuse it on a later run with "
                          "the same model, prompts, -n, --samples and --seed (decoding is most of the time; "
                          "use it to try training settings); data made with --extra-prompts or --text also serves "
                          "the same run without them")
    cal.add_argument("--json", action="store_true", help="print the result as JSON")

    t = sub.add_parser("tune", help="find the fastest k and γ for this model on this machine; --method auto uses it",
                       description="Decode the prompts with plain AR, read off exactly what each exit layer would draft "
                                   "(α by k and draft position), time c(k) and the verify cost v(k, n) here, predict the "
                                   "speedup of early exit at every (k, γ) and of prompt lookup at every γ, then time the "
                                   "best predictions against AR. The fastest measured configuration (or AR, if nothing "
                                   "beats it) is saved in the model's profile for `--method auto`; plots go to --plots.")
    _model_options(t)
    t.add_argument("--prompts", default=None,
                   help="JSONL (Spec-Bench style) or text file, one prompt per line; default: the bundled calibration "
                        "set (Spec-Bench questions that are not in the benchmark subset); 'code': the bundled "
                        "held-out code prompts (none of them in `bench --prompts code`)")
    t.add_argument("--per-category", type=int, default=1, help="first N prompts of each category (default 1)")
    t.add_argument("--max-new-tokens", "-n", type=int, default=64, help="tokens per prompt (default 64)")
    t.add_argument("--exit-layer", "-k", action="append", default=None,
                   help="exit layers to predict, repeatable or comma-separated (default: 8 from 1/4 of depth to L-1)")
    t.add_argument("--max-draft-len", "-g", type=int, default=8, help="predict γ = 1 .. this (default 8)")
    t.add_argument("--check", type=int, default=3, help="best predictions to time against AR, plus the best of each family (default 3)")
    t.add_argument("--repeats", type=int, default=3, help="timings of each c and v, median kept (default 3)")
    t.add_argument("--no-lookup", action="store_true", help="leave prompt lookup out of the candidates")
    t.add_argument("--ngram", type=int, default=3, help="prompt lookup's longest n-gram (default 3)")
    t.add_argument("--plots", default="selfspec-tune", help="directory for the PNG plots (default ./selfspec-tune)")
    t.add_argument("--no-plots", action="store_true", help="do not draw plots")
    t.add_argument("--output", default=None, help="profile file to write (default: the model's profile in the cache)")
    t.add_argument("--json", dest="json_out", default=None, help="also write everything measured as JSON to this file")
    tr = sub.add_parser(
        "train", help="fine-tune the model with the LayerSkip recipe (layer dropout + early-exit loss) so early "
                      "exits draft better; saves a new checkpoint",
        description="LayerSkip (Elhoushi et al. 2024): fine-tune every weight with layer dropout (rate rising with "
                    "depth to --p-max at the last layer) and an early-exit loss (the model's own final norm and LM "
                    "head at the exits chosen by --curriculum, weighted up with depth). Trains on --data, or by "
                    "default on the model's own greedy answers to the bundled training prompts; holds out a share "
                    "and reports before and after on it: cross-entropy at the --exit-layers and of the full model "
                    "(which training changes too), and α (the exit's greedy agreement with the full model on its "
                    "own outputs). Saves a Hugging Face checkpoint to --out that `generate --model OUT` serves.")
    _model_options(tr)
    tr.add_argument("--data", default=None, metavar="FILE",
                    help="training text: a .txt file, or a .jsonl file whose rows have 'text' (plain text) or "
                         "'turns'/'prompt' (prompts the model answers itself, greedily); default: the model's answers "
                         "to the bundled training prompts (calibration_train.jsonl, never the benchmark set)")
    tr.add_argument("--out", required=True, metavar="DIR",
                    help="directory for the trained checkpoint (model, tokenizer, selfspec_train.json); must be new "
                         "or empty")
    tr.add_argument("--steps", type=int, default=300, help="optimiser steps (default 300)")
    tr.add_argument("--lr", type=float, default=1e-4,
                    help="AdamW peak learning rate; linear warm-up over ~10%% of the steps, then cosine decay to 0 "
                         "(default 1e-4)")
    tr.add_argument("--batch-size", type=int, default=8, help="windows per step (default 8)")
    tr.add_argument("--seq-len", type=int, default=256,
                    help="tokens per window; longer documents are cut into windows (default 256)")
    tr.add_argument("--p-max", type=float, default=0.1,
                    help="layer dropout rate of the last layer, in [0, 1); layer l of L gets "
                         "p_max·(2^(l/(L-1)) - 1), 0 at the first; 0 turns layer dropout off (default 0.1)")
    tr.add_argument("--curriculum", default="rotational", choices=["rotational", "gradual", "none"],
                    help="which exits carry a loss at a step (the last layer always does): rotational, every "
                         "--rotation-th exit, the set moving by one each step; gradual, exits switched on from the "
                         "last layer down over the first half of training; none, every exit every step. Each "
                         "active exit costs one LM-head forward and backward (default rotational)")
    tr.add_argument("--rotation", type=int, default=8,
                    help="R of the rotational curriculum: about L/R exits active per step (default 8)")
    tr.add_argument("--e-scale", type=float, default=1.0,
                    help="weight of the early exits against the last layer in the loss; exit k's weight grows "
                         "as k(k-1)/2; 0 is plain fine-tuning (default 1)")
    tr.add_argument("--exit-layers", "-k", action="append", default=None, metavar="K[,K...]",
                    help="exit layers to report loss and α for, repeatable or comma-separated (default: 1/4, 1/2 "
                         "and 3/4 of the depth); training covers every exit either way")
    tr.add_argument("--num-prompts", type=int, default=120,
                    help="prompts to answer for the training data (the first N of the file; default 120)")
    tr.add_argument("--max-new-tokens", "-n", type=int, default=128,
                    help="tokens the model generates per prompt, for the data and for α (default 128)")
    tr.add_argument("--holdout", type=float, default=0.1,
                    help="share of the documents held out for the report, in (0, 1) (default 0.1)")
    tr.add_argument("--eval-every", type=int, default=None,
                    help="steps between held-out loss checks (default: a fifth of --steps)")
    tr.add_argument("--seed", type=int, default=0,
                    help="seed of the split, the batches and the layer dropout draws (default 0)")
    tr.add_argument("--json", dest="json_out", default=None, metavar="FILE",
                    help="also write the report as JSON to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    warnings.formatwarning = lambda message, *_, **__: f"selfspec: note: {message}\n"
    if getattr(args, "cache_dir", None):
        os.environ["SELFSPEC_CACHE"] = args.cache_dir
    try:
        if hasattr(args, "threads"):
            from selfspec.model.threads import apply_threads

            note = apply_threads(args.threads)
            if note:
                print(f"selfspec: {note}", file=sys.stderr)
        if args.command == "generate":
            return _generate(args)
        if args.command == "search":
            return _search(args)
        if args.command == "calc":
            return _calc(args)
        if args.command == "tune":
            return _tune(args)
        if args.command == "calibrate":
            return _calibrate(args)
        if args.command == "train":
            return _train(args)
        if args.command == "serve":
            return _serve(args)
        from selfspec.tools.bench import run_bench

        return run_bench(args)
    except (ValueError, ModuleNotFoundError, FileNotFoundError) as err:
        print(f"selfspec: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _generate(args) -> int:

    prompt = args.prompt
    if prompt is None or prompt == "-":
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise ValueError("the prompt is empty: give some text (or '-' to read standard input)")
    options = dict(
        _speculation(args), max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, stop=args.stop, chat=args.chat,
    )
    _check_options(options)
    _check_model_options(args, options)
    _check_prompt_length(args, prompt)
    model = _load(args, progress=not args.json)
    stream = model.stream(prompt, **options)
    for chunk in stream:
        if not args.json:
            print(chunk.text, end="", flush=True)
    result = stream.result
    if args.json:
        print(json.dumps({"model": model.name, "dtype": model.dtype_name, "exact": model.exact, "text": result.text,
                          "tokens": result.tokens, "stats": result.stats.to_dict()}))
    else:
        print(flush=True)
        print(result.stats.summary(), file=sys.stderr)
    return 0


def _serve(args) -> int:
    import uvicorn

    from selfspec.serve.server import create_app, log_config

    options = _speculation(args)
    _check_options(options)
    _check_model_options(args, options)
    if args.max_batch < 1 or args.max_queue < 0:
        raise ValueError("--max-batch must be >= 1 and --max-queue >= 0")
    if args.max_request_seconds < 0 or args.drain_seconds < 0:
        raise ValueError("--max-request-seconds and --drain-seconds must be >= 0")
    if args.stall_seconds <= 0:
        raise ValueError("--stall-seconds must be > 0")
    server_options = dict(max_batch=args.max_batch, max_queue=args.max_queue, api_key=args.api_key, options=options,
                          served_name=args.name, max_request_seconds=args.max_request_seconds or None,
                          stall_seconds=args.stall_seconds)
    if args.replicas is not None or args.autoscale or args.ray_address:
        return _serve_replicas(args, server_options)
    model = _load(args)
    method = args.method
    if method == "auto":
        method, k, g = model.tuned(args.profile, args.exit_layer, args.draft_len)
        method += "".join(f" {name}={v}" for name, v in (("k", k), ("γ", g)) if v is not None)
    app = create_app(model, **server_options)
    name = args.name or model.name
    print(f"selfspec: serving {name!r} on http://{args.host}:{args.port}/v1 (speculation: {method}; batch "
          f"{args.max_batch}, queue {args.max_queue}{'; API key required' if args.api_key else ''})", file=sys.stderr)
    # uvicorn waits for open requests on SIGTERM; the timeout bounds that wait, then cancels them.
    http = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                         log_config=log_config(), timeout_graceful_shutdown=args.drain_seconds))
    state = app.state.server

    def fatal(error: BaseException) -> None:  # the scheduler's thread died: exit so a supervisor restarts us
        http.should_exit = True

    state.on_fatal = fatal
    http.run()
    if state.fatal is not None:
        print(f"selfspec: error: decoding stopped ({type(state.fatal).__name__}: {state.fatal}); exiting",
              file=sys.stderr)
        return 1
    return 0


def _serve_replicas(args, server_options: dict) -> int:
    """`serve` as Ray Serve replicas (selfspec.serve.replicas), in the foreground until SIGTERM or Ctrl-C."""
    import functools
    import signal
    import threading

    from selfspec.serve import replicas

    scale = replicas.Scale.parse(args.replicas, args.autoscale)
    try:
        replicas.start_ray(args.ray_address, replicas.local_cpus(scale, args.replica_cpus), args.host, args.port)
    except ModuleNotFoundError:
        raise  # Ray is not installed: main prints the install command
    except replicas.PortTaken as error:
        print(f"selfspec: error: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # noqa: BLE001 - Ray's reasons are many; the user needs the one line
        print(f"selfspec: error: Ray could not start{' at ' + args.ray_address if args.ray_address else ''}: "
              f"{_first_line(error)}", file=sys.stderr)
        return 2
    stopping, serving = threading.Event(), threading.Event()

    def stop_request(*_):
        stopping.set()
        if not serving.is_set():
            raise KeyboardInterrupt  # still starting: unwind out of the deploy, then stop what started

    for sig in (signal.SIGINT, signal.SIGTERM):  # from here on, a stop request stops Ray and the replicas too
        signal.signal(sig, stop_request)
    try:
        try:
            url = replicas.deploy(functools.partial(_load, args), server_options, scale, host=args.host,
                                  port=args.port, replica_cpus=args.replica_cpus, drain_s=args.drain_seconds)
            serving.set()
        except KeyboardInterrupt:
            print("selfspec: stopped while the replicas were starting", file=sys.stderr)
            return 0
        except Exception as error:  # noqa: BLE001 - e.g. a replica could not load the model: Ray logged why
            print(f"selfspec: error: the replicas did not start: {_first_line(error)}", file=sys.stderr)
            return 2
        count = f"{scale.autoscale[0]}-{scale.autoscale[1]} (autoscaled)" if scale.autoscale else scale.replicas
        print(f"selfspec: serving {args.name or args.model or 'the default model'} on {url}/v1 with {count} Ray Serve "
              f"replicas (speculation: {args.method}; batch {args.max_batch}, queue {args.max_queue} each"
              f"{'; API key required' if args.api_key else ''}); /metrics shows each replica and the total",
              file=sys.stderr)
        while not stopping.wait(1):
            pass
    finally:
        replicas.stop(joined=bool(args.ray_address))
    return 0


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _speculation(args) -> dict:
    """The options `_speculation_options` defined, as SelfSpecModel.prepare takes them."""
    names = ("method", "exit_layer", "draft_len", "threshold", "skip", "skip_ratio", "every", "ngram", "profile",
             "exit_adapter", "draft_vocab", "experts", "siblings")
    return {name: getattr(args, name) for name in names}


def _load(args, **overrides):
    """The model named by the shared model options (`_model_options`); `overrides` win."""
    import selfspec

    options = dict(dtype=args.dtype, device=args.device, compile=args.compile, exact=args.exact)
    return selfspec.load(args.model, **{**options, **overrides})


def _check_model_options(args, options: dict) -> None:
    """Checks that need the model's shape or the engine mode, before the model loads: the exit
    layer against the layer count in the config on disk, and exact mode's draft-length limit."""
    from selfspec.api import check_exact_draft, default_dtype, default_exact
    from selfspec.model.loading import peek_layers

    k = options.get("exit_layer")
    n_layers = peek_layers(args.model, args.cache_dir)
    if k is not None and n_layers is not None and k > n_layers:
        raise ValueError(f"exit layer must be in 1..{n_layers} for this model, got {k}")
    dtype = default_dtype(args.device) if args.dtype == "auto" else args.dtype
    exact = default_exact(dtype) if args.exact is None else args.exact
    if exact and options.get("draft_len") is not None:
        check_exact_draft(options["draft_len"])


def _check_prompt_length(args, prompt: str) -> None:
    """Refuse, before the model loads, a prompt whose tokens alone (no chat template yet, so a
    lower bound) plus --max-new-tokens cannot fit the model's context. Needs the tokenizer and
    config on disk (a converted bundled model or a checkpoint directory); else the engine checks
    after loading."""
    from selfspec.model.loading import checkpoint_on_disk, peek_config

    root = checkpoint_on_disk(args.model, args.cache_dir)
    limit = peek_config(args.model, args.cache_dir).get("max_position_embeddings")
    if root is None or not isinstance(limit, int) or len(prompt.encode()) + args.max_new_tokens <= limit:
        return  # no tokenizer on disk, or too few bytes to overflow even at a token per byte
    try:
        from transformers import AutoTokenizer

        tokens = len(AutoTokenizer.from_pretrained(root)(prompt, add_special_tokens=False)["input_ids"])
    except (OSError, ValueError):
        return
    if tokens + args.max_new_tokens > limit:
        raise ValueError(f"the prompt ({tokens} tokens before any chat template) + --max-new-tokens "
                         f"({args.max_new_tokens}) exceeds the model's context of {limit} tokens; shorten the "
                         "prompt or lower --max-new-tokens")


def _check_options(options: dict) -> None:
    """Cheap argument checks before the (slow) model load; sampling ones only when given."""
    from selfspec.core.sampling import SamplingParams

    if "temperature" in options:
        SamplingParams(temperature=options["temperature"], top_k=options["top_k"], top_p=options["top_p"])
    if options["skip"] is not None:
        from selfspec.model.skips import SkipSet

        options["skip"] = SkipSet.parse(options["skip"])
    for name in ("every", "ngram"):
        if options[name] is not None and options[name] < 1:
            raise ValueError(f"--{name} must be >= 1, got {options[name]}")
    if options["skip_ratio"] is not None and not 0 < options["skip_ratio"] < 1:
        raise ValueError(f"--skip-ratio must be in (0, 1), got {options['skip_ratio']}")
    if options.get("experts") is not None and options["experts"] < 1:
        raise ValueError(f"--experts must be >= 1, got {options['experts']}")
    if options.get("draft_vocab") is not None and options["draft_vocab"] < 1:
        raise ValueError(f"--draft-vocab must be >= 1, got {options['draft_vocab']}")
    if options.get("siblings") is not None and not 1 <= options["siblings"] <= 15:
        raise ValueError(f"--siblings must be 1 (a chain) .. 15 (a verify takes 16 rows), got {options['siblings']}")
    if options["draft_len"] is not None and options["draft_len"] < 1:
        raise ValueError(f"--draft-len must be >= 1, got {options['draft_len']}")
    if options.get("max_new_tokens", 1) < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {options['max_new_tokens']}")
    if options["exit_layer"] is not None and options["exit_layer"] < 1:
        raise ValueError(f"--exit-layer must be >= 1, got {options['exit_layer']}")


def _calc(args) -> int:
    from selfspec.tools.calc import best_gamma, ceiling, expected_tokens, parse_values, speedup

    alphas, gammas = parse_values(args.alpha), parse_values(args.draft_len, int)
    costs, verifies = parse_values(args.cost), parse_values(args.verify)
    for a in alphas:
        ceiling(a)  # validates α before printing anything
    print("| α | γ | c | v | tokens/step | speedup | ceiling |")
    print("|---|---|---|---|---|---|---|")
    for a in alphas:
        for c in costs:
            for v in verifies:
                for g in gammas:
                    print(f"| {a:g} | {g} | {c:g} | {v:g} | {expected_tokens(a, g):.2f} | {speedup(a, g, c, v):.2f} | "
                          f"{ceiling(a):.2f} |")
    print()
    for a in alphas:
        for c in costs:
            for v in verifies:
                g = best_gamma(a, c, v)
                print(f"α {a:g}, c {c:g}, v {v:g}: best γ {g} ({speedup(a, g, c, v):.2f}×)"
                      + ("; drafting never pays" if g == 0 else ""))
    return 0


def _search(args) -> int:
    from selfspec.tools.bench import load_prompts
    from selfspec.drafters.layers.layer_skip import SECTION
    from selfspec.model.profiles import save_section
    from selfspec.tools.search import search_skip_set

    if args.iterations < 1 or args.num_prompts < 1 or args.max_new_tokens < 1 or args.draft_len < 1:
        raise ValueError("--iterations, --num-prompts, --max-new-tokens and --draft-len must be >= 1")
    prompts = [p.text for p in load_prompts(args.prompts, 10**9, default="calibration.jsonl")][: args.num_prompts]
    model = _load(args, exact=bool(args.exact), progress=not args.json)
    result = search_skip_set(model, prompts, iterations=args.iterations, max_new_tokens=args.max_new_tokens,
                             draft_len=args.draft_len, threshold=args.threshold, seed=args.seed,
                             progress=not args.json)
    section = result.profile_section(draft_len=args.draft_len, threshold=args.threshold, prompts=len(prompts),
                                     max_new_tokens=args.max_new_tokens, dtype=args.dtype)
    path = save_section(model.identity, SECTION, section, args.output)
    if args.json:
        print(json.dumps({"model": model.name, "profile": str(path), **section}))
    else:
        b = result.best
        print(f"best skip set: {b.skip.describe()} ({len(b.skip)} of {2 * model.n_layers} sublayers)")
        print(f"  {b.tokens_per_s:.1f} tok/s vs AR {result.ar_tokens_per_s:.1f} tok/s ({result.speedup:.2f}×), "
              f"α {b.alpha if b.alpha is None else round(b.alpha, 2)}, c {b.cost if b.cost is None else round(b.cost, 2)}, "
              f"{len(result.trials)} sets measured on {len(prompts)} prompts × {args.max_new_tokens} tokens")
        print(f"saved to {path}")
    return 0


def _calibrate(args) -> int:
    from selfspec.tools.bench import load_prompts
    from selfspec.tools.calibrate import calibrate, save

    if args.steps is None:
        args.steps = 2000 if args.head == "feature" else 500
    for name in ("num_prompts", "max_new_tokens", "steps", "batch_size", "generate_batch", "heads", "sequences"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.width is not None and args.width < 1:
        raise ValueError(f"--width must be >= 1, got {args.width}")
    if not args.lr > 0:
        raise ValueError(f"--lr must be > 0, got {args.lr}")
    if not 0 < args.holdout < 1:
        raise ValueError(f"--holdout must be in (0, 1), got {args.holdout}")
    prompts = [p.text for p in load_prompts(args.prompts, 10**9, default="calibration_train.jsonl")][: args.num_prompts]
    texts = []
    for path in args.text:
        try:
            with open(path, encoding="utf-8") as f:
                texts.append(f.read())
        except OSError as err:
            raise FileNotFoundError(f"cannot read --text {path}: {err.strerror}") from None
    if args.train_vocab is not None and args.train_vocab < 1:
        raise ValueError(f"--train-vocab must be >= 1, got {args.train_vocab}")
    extra = []
    if args.extra_prompts is not None:
        if args.head != "feature":
            raise ValueError("--extra-prompts is for --head feature")
        if not os.path.isfile(args.extra_prompts):
            raise FileNotFoundError(f"cannot read --extra-prompts {args.extra_prompts}: no such file")
        extra = [p.text for p in load_prompts(args.extra_prompts, 10**9)]
    model = _load(args, progress=not args.json)
    setup = dict(model=model.name, dtype=args.dtype, prompts=len(prompts),
                 prompt_source=args.prompts or "bundled calibration_train.jsonl", texts=len(texts),
                 max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    if args.head == "feature":
        setup["extra_prompts"] = len(extra)
        return _calibrate_feature(args, model, prompts, setup, texts, extra)
    if args.head == "context":
        from selfspec.tools.context_calibrate import calibrate_context

        vocab = model.adapter.lm_head.out_features
        train_vocab = args.train_vocab if args.train_vocab is not None else (32768 if vocab > 100_000 else None)
        result = calibrate_context(model, prompts, texts=texts, exit_layers=args.exit_layer,
                                   max_new_tokens=args.max_new_tokens, steps=args.steps, sequences=args.sequences,
                                   positions=args.batch_size, lr=args.lr, width=args.width, heads=args.heads,
                                   holdout=args.holdout, seed=args.seed, train_vocab=train_vocab,
                                   generate_batch=args.generate_batch, progress=not args.json)
        setup.update(head="context", heads=args.heads, sequences=args.sequences, train_vocab=result.train_vocab)
    else:
        result = calibrate(model, prompts, texts=texts, exit_layers=args.exit_layer,
                           max_new_tokens=args.max_new_tokens, steps=args.steps, batch_size=args.batch_size,
                           lr=args.lr, width=args.width, holdout=args.holdout, seed=args.seed,
                           generate_batch=args.generate_batch, progress=not args.json)
    save(result, model.identity, args.output, setup)
    if args.json:
        print(json.dumps({"model": model.name, **setup, **result.to_json()}))
        return 0
    print(f"{model.name}, {model.dtype_name}; {len(prompts)} prompts × ≤{args.max_new_tokens} tokens"
          + (f" + {len(texts)} text file(s)" if texts else "")
          + f"; {result.train_positions} training positions ({result.train_outputs} in outputs, the rest in "
            f"prompts{' and text' if texts else ''}), {result.held_out_positions} held-out output positions; "
            f"data {result.data_seconds:.0f} s; {args.steps} steps × {args.batch_size} positions per k"
          + (f" (from {args.sequences} sequences)" if args.head == "context" else ""))
    print()
    print(result.table())
    print()
    kind = "context head" if args.head == "context" else "adapter"
    for k, path in sorted(result.paths.items()):
        print(f"{kind} k={k}: {path}")
    section = "context-head" if args.head == "context" else "exit-adapter"
    print(f"profile: {result.profile} ({section}: k={result.best}, used by early exit at that k)")
    if args.head == "context":
        print("α by draft position: held out, on the model's own greedy outputs, every output position a round's "
              "start, no γ cap or confidence stop")
    if result.draft_head_path is not None:
        from selfspec.heads.draft_head import coverage

        shares = ", ".join(f"{n}: {c:.1%}" for n, c in coverage(result.token_counts).items())
        print(f"draft-head ranking: {result.draft_head_path} (share of the counted tokens the top N cover: {shares}; "
              f"use with --draft-vocab N)")
    return 0


def _calibrate_feature(args, model, prompts: list[str], setup: dict, texts: list[str], extra: list[str]) -> int:
    from selfspec.tools import feature_calibrate

    train_vocab = 8192 if args.train_vocab is None else args.train_vocab
    if args.samples < 0 or args.noise < 0:
        raise ValueError("--samples and --noise must be >= 0")
    trained = feature_calibrate.calibrate_feature(
        model, prompts, max_new_tokens=args.max_new_tokens, samples=args.samples, noise=args.noise,
        texts=texts, extra_prompts=extra, steps=args.steps, sequences=args.sequences,
        positions=args.batch_size, lr=args.lr, width=args.width, heads=args.heads, draft_vocab=train_vocab,
        holdout=args.holdout, seed=args.seed, progress=not args.json, data_path=args.data)
    setup.update(head="feature", heads=args.heads, sequences=args.sequences, samples=args.samples, noise=args.noise,
                 train_vocab=int(trained.draft_ids.numel()))
    path, profile = feature_calibrate.save(trained, model.identity, args.output, setup)
    if args.json:
        print(json.dumps({"model": model.name, **setup, **trained.summary(), "path": str(path)}))
        return 0
    print(f"{model.name}, {model.dtype_name}; {len(prompts)} prompts × ≤{args.max_new_tokens} tokens"
          + (f" + {len(extra)} extra prompts (training only)" if extra else "")
          + (f" + {len(texts)} text file(s)" if texts else "") + f"; "
          f"{trained.train_positions} training positions, {trained.held_out_positions} held-out output positions; "
          f"data {trained.data_seconds:.0f} s, training {trained.seconds:.0f} s ({args.steps} steps); "
          f"{trained.head.n_params / 1e6:.2f}M parameters, draft head of {trained.draft_ids.numel()} tokens")
    print()
    print(feature_calibrate.table(trained))
    print()
    print("α by draft position: held out, on the model's own greedy outputs, every output position a round's start, "
          "the head drafting on its own predictions, no γ cap or confidence stop")
    print(f"feature head: {path}")
    print(f"profile: {profile} (feature-head: used by --method feature)")
    return 0


def _tune(args) -> int:
    from selfspec.tools.bench import load_prompts, machine
    from selfspec.model.profiles import save_section
    from selfspec.tools.tune import SECTION, tune
    from selfspec.tools.tune.plots import write_plots

    exit_layers = [int(k) for entry in (args.exit_layer or []) for k in entry.split(",") if k.strip()] or None
    for name in ("per_category", "max_draft_len", "repeats", "ngram"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_new_tokens < 2 or args.check < 0:
        raise ValueError("--max-new-tokens must be >= 2 and --check >= 0")
    prompts = load_prompts(args.prompts, args.per_category, default="calibration.jsonl")
    model = _load(args)
    from selfspec.api import EXACT_ROWS

    if model.exact:  # exact mode's one row bucket holds a pending token and at most 3 drafts
        args.max_draft_len = min(args.max_draft_len, EXACT_ROWS - 1)
    result = tune(model, [p.text for p in prompts], max_new_tokens=args.max_new_tokens, exit_layers=exit_layers,
                  max_draft_len=args.max_draft_len, lookup=not args.no_lookup, ngram=args.ngram, check=args.check,
                  repeats=args.repeats)
    setup = dict(dtype=model.dtype_name, device=str(model.adapter.device.type), compile=model.compile, exact=model.exact,
                 machine=machine(), prompts=len(prompts),
                 prompt_source=args.prompts or "bundled calibration set", max_new_tokens=args.max_new_tokens,
                 ngram=args.ngram)
    section = result.profile_section(**setup)
    path = save_section(model.identity, SECTION, section, args.output)
    print(f"{model.name}, {model.dtype_name} on {setup['device']}; {len(prompts)} prompts × {args.max_new_tokens} tokens; "
          f"{setup['machine']}; AR {result.ar_tokens_per_s:.1f} tok/s; one step {result.costs.step_s * 1e3:.1f} ms")
    print()
    print(result.table())
    print()
    print(f"step: {result.roofline.summary()}")
    v = result.costs.verify[0]
    print("v(n), a verify over n positions in one-token steps: "
          + ", ".join(f"v({n}) {v[n]:.2f}" for n in sorted(v)))
    best = result.best
    if best is None:
        print("nothing beat plain decoding in the timed check: --method auto will run AR")
    else:
        print(f"chosen: {best.label}, measured {best.measured:.2f}× AR (predicted {best.predicted:.2f}×), "
              f"output identical to AR on {best.identical} prompts")
    print(f"profile: {path}")
    if not args.no_plots:
        for png in write_plots(result, args.plots, f"{model.name}, {model.dtype_name}, {setup['device']}"):
            print(f"plot: {png}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"model": model.name, "profile": str(path), **section}, f, indent=2, ensure_ascii=False)
    return 0


def _train(args) -> int:
    from pathlib import Path

    from selfspec.tools.train import Recipe, default_exit_layers, prepare, save, train

    recipe = Recipe(steps=args.steps, lr=args.lr, batch_size=args.batch_size, seq_len=args.seq_len,
                    p_max=args.p_max, e_scale=args.e_scale, curriculum=args.curriculum, rotation=args.rotation,
                    seed=args.seed)
    recipe.check()
    for name in ("num_prompts", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.eval_every is not None and args.eval_every < 1:
        raise ValueError(f"--eval-every must be >= 1, got {args.eval_every}")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} exists and is not an empty directory; choose a new one")
    if args.data is not None and not Path(args.data).is_file():
        raise FileNotFoundError(f"--data {args.data} is not a file")
    if args.dtype in ("int8", "int4"):
        raise ValueError(f"train fine-tunes float weights: use --dtype float32 or bfloat16, not {args.dtype}")
    if args.dtype == "auto":  # optimiser state and small updates want float32, whatever decodes fastest
        args.dtype = "float32"
    exit_layers = [int(k) for entry in (args.exit_layers or []) for k in entry.split(",") if k.strip()]
    model = _load(args, lean=False)
    exit_layers = exit_layers or default_exit_layers(model.n_layers)
    data = prepare(model, args.data, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                   seq_len=args.seq_len, holdout=args.holdout, seed=args.seed)
    print(f"{model.name}, {args.dtype} on {model.adapter.device.type}; data: {data.source}; "
          f"{len(data.train)} training windows, {len(data.held_out)} held-out windows, {len(data.prompts)} "
          f"held-out prompts for α; {args.steps} steps × {args.batch_size} windows of ≤{args.seq_len} tokens; "
          f"p_max {args.p_max}, curriculum {args.curriculum}" + (f" (R={args.rotation})" if args.curriculum ==
                                                                 "rotational" else ""), flush=True)
    result = train(model, data, recipe, exit_layers, eval_every=args.eval_every, alpha_tokens=args.max_new_tokens)
    setup = dict(model=model.name, dtype=args.dtype, data=data.source)
    save(model, out, result, setup)
    print()
    print(result.table())
    print()
    print(f"trained {result.seconds:.0f} s ({result.train_tokens} target tokens); checkpoint: {out} "
          f"(serve it with: selfspec generate --model {out})")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({**setup, **result.to_json()}, f, indent=2, ensure_ascii=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
