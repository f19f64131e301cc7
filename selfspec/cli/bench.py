"""`selfspec bench`: AR, the drafters and the reference implementations on the same prompts
(the run itself is selfspec.tools.bench.run_bench)."""

from __future__ import annotations

from selfspec.cli.options import ADVANCED, DRAFT_VOCAB_HELP, model_options
from selfspec.drafters import METHODS


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmark AR, the drafters and transformers generate() on Spec-Bench prompts",
                       usage="%(prog)s [-h] [--method METHOD] [-k K] [-g G] [-n N] [-m MODEL] [options]",
                       description="Run our AR, the chosen drafters and transformers' own greedy generate() (AR, "
                                   "its early exit at the first k and its prompt lookup, both at the first γ) on the "
                                   "same prompts in one process; print tokens/s, α, mean accepted length, c, speedups, "
                                   "peak memory and KV cache size per method and per category, and check every "
                                   "output against our AR.")
    b.add_argument("--prompts", default=None,
                   help="Spec-Bench style JSONL (question_id, category, turns); default: the bundled subset "
                        "(first 5 per category group); 'code': the bundled code prompts (function stubs and "
                        "coding tasks, 4 per category)")
    b.add_argument("--per-category", type=int, default=1, metavar="N",
                   help="first N prompts of each category (default 1)")
    b.add_argument("--max-new-tokens", "-n", type=int, default=64, metavar="N",
                   help="tokens per prompt (default 64)")
    b.add_argument("--repeats", type=int, default=1, metavar="R",
                   help="run the prompts R times over, every method on each prompt in turn, and sum (default 1); "
                        "on a noisy or shared machine 2-3 rounds spread its drift over all methods")
    b.add_argument("--json", dest="json_out", default=None, metavar="FILE",
                   help="also write the results as JSON to this file")
    b.add_argument("--markdown", default=None, metavar="FILE",
                   help="also write the results table as markdown to this file")
    b.add_argument("--llamacpp", action="store_true",
                   help="add llama.cpp's plain greedy decoding of the same GGUF at the same thread count (needs "
                        "llama-cpp-python, which builds from source: ~8 minutes on 2 cores)")
    b.add_argument("--no-hf", action="store_true",
                   help="skip the transformers generate() references (AR, early exit, prompt lookup)")
    model_options(b)
    s = b.add_argument_group("sampling")
    s.add_argument("--temperature", "-t", type=float, default=0.0,
                   help="sample at this temperature instead of greedy decoding (default 0: greedy); every method "
                        "then draws with the same seed per prompt, the transformers references are left out, and "
                        "the '= AR' column reads 'sampled'")
    s.add_argument("--seed", type=int, default=0, help="sampling seed of the first prompt; prompt i uses seed + i")
    sp = b.add_argument_group("speculation", "every combination of the methods, k and γ given runs")
    sp.add_argument("--method", action="append", default=None,
                    help="drafter(s) to run, repeatable or comma-separated, or 'all' (default early-exit, with k "
                         "and γ from `selfspec tune` when it chose early exit); auto: the tuned choice, else the "
                         "shipped one (see `selfspec generate --help`); from: "
                         + ", ".join(m for m in METHODS if m != "ar"))
    sp.add_argument("--exit-layer", "-k", type=int, action="append", default=None, metavar="K",
                    help="exit layer(s) to run, repeatable (default: the tuned k when `selfspec tune` chose early "
                         "exit, else 3/4 of depth)")
    sp.add_argument("--draft-len", "-g", type=int, action="append", default=None, metavar="G",
                    help="draft length(s) to run, repeatable; early exit runs each, the other methods the first "
                         "(default: early exit the tuned γ when `selfspec tune` chose it, else 4; the others their "
                         "own, as in `selfspec generate --help`)")
    a = b.add_argument_group(*ADVANCED)
    a.add_argument("--draft-vocab", type=int, default=None, metavar="N", help=DRAFT_VOCAB_HELP)
    a.add_argument("--siblings", type=int, default=None, metavar="M",
                   help="feature and hybrid: the head's M likeliest next tokens as alternatives verified in one "
                        "forward (default: feature 1; hybrid 2 on CPUs with AMX, else 1)")
    a.add_argument("--experts", type=int, action="append", default=None, metavar="N",
                   help="expert-subset's routed experts per token per MoE layer, repeatable (default 1; "
                        "mixture-of-experts models only, which `--method all` then includes)")


def run(args) -> int:
    from selfspec.tools.bench import run_bench

    return run_bench(args)
