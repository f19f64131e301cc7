"""`selfspec bench`: our AR, each chosen drafter (early-exit at each (k, γ); layer-skip, SWIFT,
CLaSp, ConfLayers, lookup, hybrid with their defaults or profiles) and transformers' own generate()
(greedy AR, its LayerSkip-style early exit and prompt lookup decoding), on the same Spec-Bench
prompts in one process, greedy, batch 1.

Methods run interleaved prompt by prompt, so machine noise spreads over all of them. Every output
is compared token by token with our AR's: a speedup only counts if the output is the same. Each
generation's peak memory (selfspec.tools.memory) and KV cache bytes are recorded beside its speed.
"""

from __future__ import annotations

import json
import platform
import shlex
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm import tqdm

from selfspec.tools.divergence import divergence
from selfspec.core.engine import check_length
from selfspec.core.speculation import Speculation
from selfspec.tools.hf_reference import hf_generate, reference_configs
from selfspec.tools.memory import MIB, MemoryUse, peak_memory
from selfspec.tools.roofline import roofline
from selfspec.core.stats import GenerationStats
from selfspec.model.quantize import Int4Linear



@dataclass
class Prompt:
    question_id: int
    category: str
    text: str


class Run(NamedTuple):
    """One generation of one method."""

    tokens: list[int]  # without EOS
    seconds: float
    stats: GenerationStats | None  # None where no draft rounds were counted (transformers' AR)
    kv_bytes: int  # every KV cache the method held at the end


@dataclass
class Tally:
    """Totals of one method over a set of prompts; memory figures are the max over them."""

    tokens: int = 0
    seconds: float = 0.0
    identical: int = 0
    near_ties: int = 0  # runs that differ from AR first where AR's top-2 logits nearly tie (selfspec.tools.divergence)
    runs: int = 0
    stats: GenerationStats | None = None  # merged over the prompts; None for transformers' AR
    peak_bytes: int = 0
    extra_bytes: int = 0  # peak minus what was in use just before the generation
    kv_bytes: int = 0
    sampled: bool = False  # temperature > 0: outputs follow the same distribution, not AR's tokens

    def add(self, run: Run, identical: bool, memory: MemoryUse, near_tie: bool = False) -> None:
        self.tokens += len(run.tokens)
        self.seconds += run.seconds
        self.identical += identical
        self.near_ties += near_tie
        self.runs += 1
        self.peak_bytes = max(self.peak_bytes, memory.peak)
        self.extra_bytes = max(self.extra_bytes, memory.extra)
        self.kv_bytes = max(self.kv_bytes, run.kv_bytes)
        if run.stats is not None:
            if self.stats is None:
                self.stats = GenerationStats(run.stats.method, run.stats.exit_layer, run.stats.draft_len)
            self.stats.merge(run.stats)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after each run's first (which the prefill makes) per second after the prefill:
        the rate drafting can change, where tok/s also counts the prompt's prefill (most of the
        time on the ~1,000-token summarization and RAG prompts). None without engine stats."""
        if self.stats is None:
            return None
        seconds = self.seconds - self.stats.prefill_s
        return (self.tokens - self.runs) / seconds if seconds > 0 else None

    def summary(self) -> dict:
        def rounded(x):
            return None if x is None else round(x, 3)

        stats = self.stats
        return {
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "decode_tokens_per_s": rounded(self.decode_tokens_per_s),
            "alpha": rounded(stats.alpha) if stats else None,
            "mean_accepted_length": rounded(stats.mean_accepted_length) if stats else None,
            "cost": rounded(stats.cost) if stats else None,
            "search_s": rounded(stats.search_s) if stats and stats.searches else None,
            "identical_to_ar": "sampled" if self.sampled else f"{self.identical}/{self.runs}",
            "near_ties": self.near_ties,
            "peak_mib": round(self.peak_bytes / MIB, 1),
            "extra_mib": round(self.extra_bytes / MIB, 1),
            "kv_mib": round(self.kv_bytes / MIB, 2),
        }


@dataclass
class Method:
    label: str
    method: str  # a drafter name (ours), "hf" (transformers generate) or "llamacpp"
    speculation: Speculation | None = None  # ours: the method and its options; None: the method's defaults
    hf_kwargs: dict = field(default_factory=dict)  # "hf": extra generate() arguments; none is its AR
    reference_k: int | None = None  # "hf": the exit layer its early exit was given, reported as k
    engine: object | None = None  # "llamacpp": the LlamaCpp instance that runs it
    total: Tally = field(default_factory=Tally)
    by_category: dict[str, Tally] = field(default_factory=dict)

    @property
    def exit_layer(self) -> int | None:
        """k, as the report shows it."""
        return self.speculation.exit_layer if self.speculation is not None else self.reference_k


BENCH_SET = "spec_bench_subset.jsonl"
# Bundled prompt sets by name (--prompts NAME): the benchmark's file, and the held-out file that
# tune, search and calibrate use instead, so nothing is tuned on the prompts it is measured on.
# "chat" names the default Spec-Bench sets.
PROMPT_SETS = {"code": ("code_bench.jsonl", "code_calibration.jsonl")}


def load_prompts(path: str | None, per_category: int, default: str = BENCH_SET) -> list[Prompt]:
    """Prompts from a Spec-Bench style JSONL file (rows with "turns", or "prompt"/"text", and an
    optional "category"), a plain text file (one prompt per line), or a bundled set (by name, or
    `default` when path is None); the first `per_category` of each category."""
    if path == "chat":
        path = None
    elif path in PROMPT_SETS:
        bench_file, held_out = PROMPT_SETS[path]
        path, default = None, bench_file if default == BENCH_SET else held_out
    if path is None:
        text, path = resources.files("selfspec").joinpath(f"data/{default}").read_text(), None
    else:
        text = Path(path).read_text()
    jsonl = path is None or str(path).endswith((".jsonl", ".json")) or text.lstrip().startswith("{")
    taken: dict[str, int] = {}
    prompts = []
    for line_no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if jsonl:
            try:
                row = json.loads(line)
                turn = row["turns"][0] if "turns" in row else row.get("prompt", row.get("text"))
                if not isinstance(turn, str):
                    raise KeyError("turns")
                category = row.get("category", "all")
            except (json.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError) as err:
                raise ValueError(f"{path}:{line_no}: not a prompt row (needs 'turns': [text, ...] or "
                                 f"'prompt': text): {err}") from err
        else:
            row, category, turn = {}, "all", line.strip()
        if taken.get(category, 0) < per_category:
            taken[category] = taken.get(category, 0) + 1
            prompts.append(Prompt(row.get("question_id", line_no), category, turn))
    if not prompts:
        raise ValueError(f"no prompts found in {path or 'the bundled ' + default}")
    return prompts


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = f"{torch.cuda.get_device_name()}, " if torch.cuda.is_available() and torch.cuda.is_initialized() else ""
    return f"{gpu}{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def run_bench(args) -> int:
    import selfspec

    rounds = getattr(args, "repeats", None)
    rounds = 1 if rounds is None else rounds
    if rounds < 1:
        raise ValueError(f"--repeats must be at least 1, got {rounds}")
    prompts = load_prompts(args.prompts, args.per_category)
    model = selfspec.load(args.model, dtype=args.dtype, device=args.device, compile=args.compile, exact=args.exact,
                          head=getattr(args, "head_dtype", "int8"))
    methods = [Method("ar (ours)", "ar", Speculation("ar"))] + _methods(args, model)
    temperature = getattr(args, "temperature", 0.0) or 0.0
    if temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {temperature}")
    if not args.no_hf and not temperature:  # transformers' references run greedy only
        methods += hf_methods(args, model)
    if getattr(args, "llamacpp", False):
        from selfspec.tools.llamacpp_reference import LlamaCpp, gguf_file

        with gguf_file(args.model) as path:  # a file assembled for it is removed once llama.cpp mapped it
            engine = LlamaCpp(path, threads=torch.get_num_threads())
        methods.append(Method(f"llama.cpp, same GGUF, plain greedy ({engine.threads} threads)", "llamacpp",
                              engine=engine))
    encoded = [model.encode(p.text) for p in prompts]
    n = args.max_new_tokens
    for ids in encoded:
        check_length(model.adapter, ids.numel(), n)

    methods = warm_up(model, methods, encoded[0], min(n, 8))
    if model.adapter.step is not None and model.adapter.step.graphs is not None:
        # CUDA graphs are captured per cache size (and compiled code specialised on it): warm up on
        # the longest prompt too, so that no timed run captures or compiles.
        longest = max(encoded, key=len)
        if len(longest) != len(encoded[0]):
            methods = warm_up(model, methods, longest, n)
    # Each round runs every prompt once, the methods one after another on each prompt, so a drift in
    # this machine's speed (a busy neighbour, a VM's bandwidth moving minute to minute) hits them all
    # alike; the tallies sum over the rounds.
    bar = tqdm(total=rounds * len(prompts) * len(methods), desc="bench", unit="run", file=sys.stderr)
    for i, (prompt, ids) in [(i, pair) for _ in range(rounds) for i, pair in enumerate(zip(prompts, encoded))]:
        reference = None
        # Sampling: every method draws with the same seed per prompt; the outputs are samples of the
        # same distribution (tests/lossless.py checks that), not the same tokens, so "= AR" is moot.
        sampling = dict(temperature=temperature, seed=getattr(args, "seed", 0) + i) if temperature else {}
        for m in methods:
            with peak_memory(model.adapter.device) as memory:
                run = _run(model, m, ids, n, sampling)
            if m.method == "ar":
                reference = run.tokens
            same = run.tokens == reference
            near_tie = False
            if sampling:
                m.total.sampled = True
                m.by_category.setdefault(prompt.category, Tally()).sampled = True
            elif not same and m.method != "llamacpp":  # llama.cpp runs the quantized model: its own tokens
                found = divergence(model.adapter, ids, reference, run.tokens)
                near_tie = found.near_tie
                tqdm.write(f"{m.label}, {prompt.category}: {found}", file=sys.stderr)
            m.total.add(run, same, memory, near_tie)
            m.by_category.setdefault(prompt.category, Tally()).add(run, same, memory, near_tie)
            bar.update()
    bar.close()

    report = _report(model, methods, prompts, args)
    print(report["markdown"])
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2, ensure_ascii=False))
    if args.markdown:
        Path(args.markdown).write_text(report["markdown"])
    return 0


def _methods(args, model) -> list[Method]:
    """The drafters to run: early-exit for every (k, γ) asked; any other drafter once, with the
    first γ asked (or its own default) and its profile when the model has one. `auto` is what
    `selfspec tune` chose; early exit without -k/-g takes k and γ from the tune when it chose early
    exit."""
    from selfspec.drafters import FEATURE_MIN_NGRAM, METHODS
    from selfspec.model.moe import experts_per_token
    from selfspec.model.profiles import load_profile
    from selfspec.tools.tune import SECTION as TUNE

    profile = load_profile(model.identity)
    tuned = profile.get(TUNE) or {}
    names = [name for entry in (args.method or ["early-exit"]) for name in entry.split(",")]
    top_k = experts_per_token(model.adapter.layers)  # None: a dense model, which expert-subset cannot draft
    if "all" in names:
        names = (["auto"] if tuned else []) + [m for m in METHODS if m != "ar" and (top_k or m != "expert-subset")]
    unknown = sorted(set(names) - set(METHODS) - {"auto"})
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; choose from: all, auto, {', '.join(METHODS)}")
    from_tune = tuned.get("method") == "early-exit"
    exit_layers = args.exit_layer or [tuned["exit_layer"] if from_tune else model.default_exit_layer()]
    draft_lens = args.draft_len or ([tuned["draft_len"]] if from_tune else [None])
    siblings = getattr(args, "siblings", None)
    out = []
    for name in dict.fromkeys(names):
        if name == "ar":
            continue
        if name == "auto":
            # What `generate --method auto` runs: the tune's choice, else the shipped one, else AR.
            method, k, g = (tuned["method"], tuned.get("exit_layer"), tuned.get("draft_len")) if tuned else \
                model.tuned(None, None, None)
            spec = Speculation.relevant(method, exit_layer=k, draft_len=g, siblings=siblings)
            what = method + (f" k={k}" if k else "") + (f" γ={g}" if g else "")
            what += _feature_tag(model.resolve(spec))
            source = "tuned" if tuned else "shipped" if method != "ar" else "no profile"
            out.append(Method(f"auto ({source}: {what})", method, spec))
        elif name == "early-exit":
            tag = " (tuned)" if from_tune and not (args.exit_layer or args.draft_len) else ""
            vocab = getattr(args, "draft_vocab", None)
            tag += f" V={vocab}" if vocab else ""
            out += [Method(f"early-exit k={k} γ={g or 4}{tag}{_adapter_tag(profile, k)}", name,
                           Speculation(name, exit_layer=k, draft_len=g or 4, draft_vocab=vocab))
                    for k in exit_layers for g in draft_lens]
        elif name == "expert-subset":
            if top_k is None:
                raise ValueError(f"--method expert-subset needs a mixture-of-experts model; {model.name} is dense")
            out += [Method(f"expert-subset {e}/{top_k} experts γ={draft_lens[0] or 4}", name,
                           Speculation(name, draft_len=draft_lens[0], experts=e))
                    for e in getattr(args, "experts", None) or [1]]
        elif name == "hybrid":
            asked = args.exit_layer[0] if args.exit_layer else None
            resolved = model.resolve(Speculation(name, exit_layer=asked, draft_len=draft_lens[0], siblings=siblings))
            k = None if resolved.fallback == "feature" else exit_layers[0]
            m = resolved.speculation.siblings or 1
            first = f"feature's {m} siblings" if m > 1 else "feature γ=1"
            what = {"layer-skip": "layer-skip", "early-exit": f"early-exit k={k}",
                    "feature": f"{first}, lookup suffix ≥ {FEATURE_MIN_NGRAM}, no gates"}[resolved.fallback]
            out.append(Method(f"hybrid (lookup, else {what})", name,
                              Speculation(name, exit_layer=k, draft_len=draft_lens[0], siblings=siblings)))
        else:
            label = name if draft_lens[0] is None else f"{name} γ≤{draft_lens[0]}"
            if name == "layer-skip":
                label += " (searched profile)" if "layer-skip" in profile else " (untuned default)"
            vocab = getattr(args, "draft_vocab", None) if name == "feature" else None
            sib = siblings if name == "feature" else None
            label += (f" V={vocab}" if vocab else "") + (f", {sib} siblings" if sib and sib > 1 else "")
            out.append(Method(label, name, Speculation.relevant(name, draft_len=draft_lens[0], draft_vocab=vocab,
                                                                siblings=sib)))
    return out


def _feature_tag(resolved) -> str:
    """What hybrid's feature fallback drafts, for a label ('' for anything else)."""
    if resolved.fallback != "feature":
        return ""
    m = resolved.speculation.siblings or 1
    return f", feature's {m} siblings" if m > 1 else ", feature γ=1"


def _adapter_tag(profile: dict, k: int) -> str:
    """' + context head' or ' + exit adapter' when early exit at k will use the profile's trained one."""
    from selfspec.heads import context_head
    from selfspec.heads.exit_adapter import profile_section

    section = profile_section(profile, k)
    if section is None:
        return ""
    return " + context head" if section is profile.get(context_head.SECTION) else " + exit adapter"


def warm_up(model, methods: list[Method], ids: torch.Tensor, n: int) -> list[Method]:
    """Run every method once outside the timed runs (allocator, kernels for each shape); return
    those that ran. A transformers method this model cannot run (say, no early exit) is dropped
    with a note on stderr; any failure of ours is raised."""
    ran = []
    for m in methods:
        try:
            _run(model, m, ids, n)
        except Exception as err:
            if m.method != "hf":
                raise
            note = f"{type(err).__name__}: {err}".splitlines()[0]
            print(f"selfspec bench: dropping {m.label}: {note}", file=sys.stderr)
            continue
        ran.append(m)
    return ran


def hf_methods(args, model) -> list[Method]:
    """transformers' references (see hf_reference) at the first k asked (or the model's default
    k) and the first γ asked."""
    k = (args.exit_layer or [model.default_exit_layer()])[0]
    gamma = (args.draft_len or [None])[0]
    out = []
    for label, kwargs in reference_configs(k, gamma):
        early = "assistant_early_exit" in kwargs
        out.append(Method(label, "hf", hf_kwargs=kwargs, reference_k=k if early else None))
    return out


def _run(model, m: Method, ids: torch.Tensor, n: int, sampling: dict | None = None) -> Run:
    """One generation of `m`, at most `n` new tokens: greedy, or with `sampling` (temperature, seed)."""
    if m.method == "hf":
        return Run(*hf_generate(model, ids, n, m.hf_kwargs))
    if m.method == "llamacpp":
        tokens, seconds = m.engine.generate(ids, n, model.eos_ids)
        return Run(tokens, seconds, None, 0)
    result = model.generate(ids, speculation=m.speculation or Speculation(m.method), max_new_tokens=n,
                            **(sampling or {}))
    return Run(result.tokens, result.stats.wall_s, result.stats, result.stats.kv_cache_bytes)


def _report(model, methods: list[Method], prompts: list[Prompt], args) -> dict:
    ar = methods[0]
    hf = next((m for m in methods if m.method == "hf" and not m.hf_kwargs), None)
    categories = sorted({p.category for p in prompts})

    def row(m: Method, tally: Tally, ar_tally: Tally, hf_tally: Tally | None) -> dict:
        gamma = tally.stats.draft_len if tally.stats else None
        out = {"method": m.label, "k": m.exit_layer, "gamma": gamma or None, **tally.summary(),
               "speculation": m.speculation.to_dict() if m.speculation is not None else None}
        out["speedup_vs_ar"] = round(tally.tokens_per_s / ar_tally.tokens_per_s, 3) if ar_tally.tokens_per_s else None
        decode, ar_decode = tally.decode_tokens_per_s, ar_tally.decode_tokens_per_s
        out["decode_speedup_vs_ar"] = round(decode / ar_decode, 3) if decode and ar_decode else None
        if hf_tally is not None and hf_tally.tokens_per_s:
            out["speedup_vs_hf"] = round(tally.tokens_per_s / hf_tally.tokens_per_s, 3)
        return out

    overall = [row(m, m.total, ar.total, hf.total if hf else None) for m in methods]
    per_category = {
        c: [row(m, m.by_category[c], ar.by_category[c], hf.by_category[c] if hf else None) for m in methods]
        for c in categories
    }
    step = model.adapter.step
    engine = ("lean step, " + ("compiled" if step.compile else "eager") + (", exact" if step.exact_rows else "")
              if step is not None else "general path")
    ar_decode = ar.total.decode_tokens_per_s  # the step: AR's seconds per token after the prefill
    ar_step_s = 1 / ar_decode if ar_decode else (ar.total.seconds / ar.total.tokens if ar.total.tokens else None)
    setup = (
        f"model {model.name} ({model.n_layers} layers), {model.dtype_name}"
        f"{', 4-bit head' if isinstance(model.adapter.lm_head, Int4Linear) else ''}, {engine}, device {args.device}; "
        f"{roofline(model.hf_model, ar_step_s).summary()} (step: our AR's seconds per token after the prefill); "
        f"{len(prompts)} Spec-Bench prompts ({args.per_category} per category: {', '.join(categories)}; "
        f"{'bundled subset' if args.prompts is None else args.prompts}), first turn, chat template when the model has one, "
        f"{_decoding(args)}, max {args.max_new_tokens} new tokens, batch 1{_rounds(args)}; machine: {machine()}; "
        f"command: {shlex.join(['selfspec', *sys.argv[1:]])}"
    )
    memory = (
        "Memory per generation, the most over the prompts: peak MiB is the process's peak resident set "
        "(weights included) on CPU, the most CUDA memory allocated on a GPU; Δ MiB is that peak minus the "
        "figure just before the generation; KV MiB is every KV cache held at its end. Ours is one cache, "
        "preallocated for prompt + max new tokens + γ + 1 positions and shared by draft and verify; "
        "transformers' grows with the text, and its early exit keeps a second one for the draft's layers."
    )
    lines = [f"Setup: {setup}", "", memory, "", _table(overall), ""]
    for c in categories:
        lines += [f"Category {c}:", "", _table(per_category[c]), ""]
    return {"setup": setup, "memory": memory, "overall": overall, "per_category": per_category,
            "markdown": "\n".join(lines)}


def _rounds(args) -> str:
    rounds = getattr(args, "repeats", None) or 1  # run_bench has refused any below 1
    return f"; {rounds} rounds over the prompts, summed (the methods interleaved per prompt)" if rounds > 1 else ""


def _decoding(args) -> str:
    temperature = getattr(args, "temperature", 0.0) or 0.0
    if not temperature:
        return "greedy"
    return f"sampled at temperature {temperature} (seed {getattr(args, 'seed', 0)} + prompt index, the same for every method)"


def _table(rows: list[dict]) -> str:
    cols = [("method", "method"), ("k", "k"), ("gamma", "γ"), ("tokens_per_s", "tok/s"),
            ("speedup_vs_ar", "× our AR"), ("decode_speedup_vs_ar", "× AR, decode"), ("speedup_vs_hf", "× HF"),
            ("alpha", "α"),
            ("mean_accepted_length", "acc/step"), ("cost", "c"), ("search_s", "search s"),
            ("peak_mib", "peak MiB"), ("extra_mib", "Δ MiB"), ("kv_mib", "KV MiB"), ("identical_to_ar", "= AR"),
            ("near_ties", "near-tie divergences")]

    def cell(v):
        return "–" if v is None else str(v)

    out = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(cell(r.get(key)) for key, _ in cols) + " |" for r in rows]
    return "\n".join(out)
