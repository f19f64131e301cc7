"""The Python API: `load` a model, then `generate` (text, tokens, statistics) or `stream` it.

    import selfspec
    model = selfspec.load()                       # SmolLM2-135M-Instruct, bundled
    result = model.generate("Why is the sky blue?", method="lookup", draft_len=3)
    result = model.generate("Why is the sky blue?", speculation=selfspec.Speculation("early-exit", exit_layer=26))
    print(result.text, result.stats.summary())
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from selfspec.native import gemv
from selfspec.model.adapter import ModelAdapter
from selfspec.drafters import Drafter, make_drafter
from selfspec.core.engine import check_length, decode
from selfspec.core.speculation import AUTO, TAKES, Resolved, Speculation
from selfspec.heads.exit_adapter import DISABLED, adapter_exit_layer
from selfspec.model.loading import LoadedModel, load_hf
from selfspec.model.quantized_cache import load_quantized
from selfspec.model.profiles import ENGINE, TUNE_SECTION, ModelIdentity, load_profile, runs_here, shipped_choice
from selfspec.model.quantize import ACTIVATION_DTYPE, quantize_int4, quantize_int8
from selfspec.core.sampling import SamplingParams
from selfspec.core.stats import GenerationStats
from selfspec.model.step import unsupported_reason

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NOTED_UNTUNED: set[str] = set()  # models whose "no tuned profile" note this process has given
EXACT_ROWS = 4  # exact mode's one row bucket: drafts of up to 3 tokens (a 4-row product costs ~1.1 one-row ones here)
# Device type -> compile the decode step unless told otherwise (measured: README, "The lean step").
COMPILE_BY_DEFAULT = {"cpu": False, "cuda": True}


@dataclass
class Chunk:
    tokens: list[int]  # tokens committed by one verify round
    text: str  # the text they add (held back while it may still become part of a stop string)


@dataclass
class Generation:
    text: str
    tokens: list[int]
    stats: GenerationStats


@dataclass
class Stream:
    """Iterate for chunks as they are committed; `result` is complete once iteration ends."""

    _chunks: Iterator[Chunk]
    result: Generation

    def __iter__(self) -> Iterator[Chunk]:
        return self._chunks

    @property
    def stats(self) -> GenerationStats:
        return self.result.stats


@dataclass
class SelfSpecModel:
    hf_model: torch.nn.Module
    tokenizer: object | None = None  # None: prompts must be token ids
    name: str = "model"
    # The lean step (selfspec.model.step) runs drafts and verifies where the model supports it; compile
    # compiles it per row bucket; exact runs every forward in EXACT_ROWS rows (greedy identity by
    # construction, on any CPU or GPU).
    lean: bool = True
    compile: bool = False
    exact: bool = False
    dtype_name: str | None = None  # what `load` was asked for ("int8", "int4" run bfloat16 activations)
    adapter: ModelAdapter = field(init=False)
    # Drafters by their options, kept for the session: adaptive ones (SWIFT) carry what they
    # learned on one prompt over to the next.
    _drafters: dict = field(init=False, default_factory=dict, repr=False)
    # The suffix store: every request's prompt and output, by tenant, for `suffix` (None: none made yet).
    suffix_tokens: int = 1_000_000  # the suffix store's budget in tokens, over all tenants (the oldest text goes past it)
    _suffix: object = field(init=False, default=None, repr=False)
    _suffix_lock: threading.Lock = field(init=False, default_factory=threading.Lock, repr=False)
    # One prefix store, its entries by tenant (as the suffix stores): earlier generations' cache
    # entries that a new prompt starting with the same tokens reuses (`keep_prefixes`; None: none kept).
    _prefix: object = field(init=False, default=None, repr=False)

    def __post_init__(self):
        self.adapter = ModelAdapter(self.hf_model)
        if self.dtype_name is None:
            self.dtype_name = str(self.adapter.dtype).removeprefix("torch.")
        self.identity = ModelIdentity.of(self.hf_model, self.name)
        reason = unsupported_reason(self.adapter)
        if reason is not None and (self.compile or self.exact):
            raise ValueError(f"--compile and --exact need the lean step, which does not support {self.name} "
                             f"({reason}); run without them")
        if reason is None and (self.lean or self.compile or self.exact):
            self.adapter.lean(compile=self.compile, exact_rows=EXACT_ROWS if self.exact else None)

    @property
    def n_layers(self) -> int:
        return self.adapter.n_layers

    @property
    def eos_ids(self) -> frozenset[int]:
        ids = set()
        for source in (getattr(self.hf_model, "generation_config", None), self.tokenizer):
            eos = getattr(source, "eos_token_id", None)
            ids.update(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
        return frozenset(ids)

    def default_exit_layer(self) -> int:
        """k when none is given: three quarters of the depth (see README for measured α per k)."""
        return max(1, (3 * self.n_layers) // 4)

    def encode(self, prompt: str | Sequence[int], chat: bool | None = None) -> torch.Tensor:
        """Prompt text (or token ids) -> ids [n]. chat=None applies the chat template if the model has one."""
        if not isinstance(prompt, str):
            ids = torch.as_tensor(list(prompt), dtype=torch.long).view(-1)
            vocab = self.adapter.embed_tokens.num_embeddings
            if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < vocab):
                raise ValueError(f"token ids must be in 0..{vocab - 1} for {self.name}")
            return ids
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids instead of text")
        if not prompt.strip():
            raise ValueError("the prompt is empty: give some text")
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        if chat is None:
            chat = has_template
        if chat:
            if not has_template:
                raise ValueError(f"{self.name} has no chat template; use --no-chat (chat=False)")
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            ids = ids["input_ids"] if not isinstance(ids, list) else ids
        else:
            ids = self.tokenizer(prompt)["input_ids"]
        return torch.as_tensor(ids, dtype=torch.long)

    def prepare(
        self,
        prompt: str | Sequence[int],
        *,
        speculation: Speculation | None = None,
        drafter: Drafter | None = None,
        fresh_drafter: bool = False,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        chat: bool | None = None,
        tenant: str | None = None,
        **options,
    ) -> Prepared:
        """Check a generation's arguments and resolve them (tokens, drafter, sampling), before any
        model work; `stream`, `generate` and the server take the same options.

        speculation: the method and its options (selfspec.core.speculation.Speculation, which says
        what each option means), or the same as keywords: method="lookup", draft_len=3, ... (not
        both). The method "auto" (the default) runs what `selfspec tune` chose for this model on
        this machine, else the choice shipped for it (selfspec/data/shipped_profiles.json) where one
        was measured faster than plain decoding here, else plain decoding (see `tuned`).
        drafter: a drafter instance to use instead (its state carries over between calls).
        fresh_drafter: a new drafter instance even if one for the same speculation exists (the
        server: each concurrent request needs its own). tenant: whose suffix store `suffix` drafts
        from and adds to (None: the model's shared one; see `suffix_store`).
        """
        if speculation is None:
            speculation = Speculation.from_options(**options)
        elif options:
            raise TypeError(f"give speculation= or its options as keywords ({', '.join(options)}), not both")
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        if drafter is None:
            resolved = self.resolve(speculation, tenant)
            if fresh_drafter:
                drafter = make_drafter(resolved)
            else:
                if resolved not in self._drafters:
                    self._drafters[resolved] = make_drafter(resolved)
                drafter = self._drafters[resolved]
        ids = self.encode(prompt, chat)
        stop = [s for s in ([stop] if isinstance(stop, str) else stop) if s]
        if stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        if self.adapter.exact:
            check_exact_draft(drafter.draft_len, self.exact_limit())
        stats = GenerationStats(method=drafter.name, exit_layer=drafter.exit_layer, draft_len=drafter.draft_len)
        check_length(self.adapter, ids.numel(), max_new_tokens)
        return Prepared(ids, drafter, sampling, max_new_tokens, stop, stats, self.eos_ids, self.prefix_store(tenant))

    def exact_rows(self) -> int:
        """The most rows exact mode verifies in one call: where the fused layer runs (eager, the
        kernel built) each row's arithmetic is its own whatever the rows beside it, so any count up
        to its ROWS is exact unpadded (and longer verifies run in calls of ROWS: `exact_limit`);
        elsewhere (PyTorch's kernels, compiled, CUDA) every forward is padded to the one bucket
        EXACT_ROWS."""
        from selfspec.native import fused_layer

        return fused_layer.ROWS if self.adapter.runs_fused(fused_layer.ROWS) else EXACT_ROWS

    def exact_limit(self) -> int | None:
        """The most rows an exact verify may have: none (any draft length) where the fused layer
        runs, EXACT_ROWS where every forward is padded to that bucket."""
        return None if self.exact_rows() > EXACT_ROWS else EXACT_ROWS

    def suffix_store(self, tenant: str | None = None):
        """This model's suffix store as `tenant` sees it (None: the text every request shares): the
        prompts and outputs `suffix` drafts from (selfspec.drafters.suffix; one store and one
        budget for all tenants, each drafting from its own text only)."""
        from selfspec.drafters.suffix import Scoped, SuffixStore

        with self._suffix_lock:
            if self._suffix is None:
                self._suffix = SuffixStore(self.suffix_tokens)
            return Scoped(self._suffix, tenant)

    def suffix_stores(self) -> list:
        """The suffix store, if one was made (a list: none or one)."""
        with self._suffix_lock:
            return [] if self._suffix is None else [self._suffix]

    def reset_suffix_stores(self) -> None:
        """Forget every request's text (a benchmark's fresh start)."""
        with self._suffix_lock:
            self._suffix = None

    def keep_prefixes(self, budget_bytes: int) -> None:
        """Keep each finished generation's cache entries (prompt and answer), up to budget_bytes
        over all tenants, the least recently used dropped first; a later prompt that starts with the same
        tokens prefills only the rest (selfspec.model.prefix_cache). Output is unchanged: from now
        on every prefill runs through the fused layer, whose keys and values do not depend on how
        a prompt is split. 0 stops keeping them. Raises ValueError where reuse would not be exact."""
        from selfspec.model.prefix_cache import PrefixStore

        if budget_bytes < 0:
            raise ValueError(f"the prefix budget must be >= 0 bytes, got {budget_bytes}")
        reason = PrefixStore.available(self.adapter) if budget_bytes else None
        if reason is not None:
            raise ValueError(f"{self.name} cannot reuse prefixes exactly here: {reason}")
        with self._suffix_lock:
            self._prefix = PrefixStore(budget_bytes) if budget_bytes else None
        if self.adapter.step is not None:
            self.adapter.step.rowwise_prefill = budget_bytes > 0

    @property
    def prefix_bytes(self) -> int:
        """The prefix store's budget (`keep_prefixes`), 0 where none is kept."""
        return 0 if self._prefix is None else self._prefix.budget_bytes

    def prefix_store(self, tenant: str | None = None):
        """The prefix store as `tenant` sees it (None: the shared entries), or None where none is kept."""
        with self._suffix_lock:
            return None if self._prefix is None else self._prefix.scoped(tenant)

    def prefix_stores(self) -> list:
        """The prefix store (its entries over every tenant), in a list: [] where none is kept."""
        with self._suffix_lock:
            return [] if self._prefix is None else [self._prefix]

    def resolve(self, speculation: Speculation, tenant: str | None = None) -> Resolved:
        """The speculation made concrete for this model on this machine, checked once, before the
        registry builds its drafter: auto becomes the tuned or shipped choice (options its method
        does not take are dropped), γ defaults to what exact mode's row bucket holds, k is checked
        against the depth and filled in where the draft exits at a layer (the profile's exit
        adapter's or context head's k, else `default_exit_layer`), the profile is read, files named
        must exist, and hybrid's fallback and siblings are chosen (from the profile, the feature
        head's presence and the CPU's kernel path)."""
        s = speculation
        if s.method == AUTO:
            method, k, g = self.tuned(s.profile, s.exit_layer, s.draft_len)
            s = Speculation.relevant(method, **{**s.options(), "exit_layer": k, "draft_len": g})
        if self.adapter.exact and s.draft_len is None and "draft_len" in TAKES[s.method]:
            # The tuned bucket's 3, as every method was measured; suffix's long matches take all rows exact here.
            s = replace(s, draft_len=self.exact_rows() - 1 if s.method == "suffix" else EXACT_ROWS - 1)
        s.validate(self.n_layers)
        if self.adapter.exact and s.draft_len is not None:
            check_exact_draft(s.draft_len, self.exact_limit())
        saved = load_profile(self.identity, s.profile)
        if s.exit_adapter is not None and s.exit_adapter not in DISABLED and not Path(s.exit_adapter).expanduser().is_file():
            raise FileNotFoundError(f"no exit adapter at {s.exit_adapter}")
        fallback = None
        if s.method == "hybrid":
            fallback = ("layer-skip" if s.skip or saved.get("layer-skip") else
                        "feature" if s.exit_layer is None and has_feature_head(saved, self.identity) else "early-exit")
            if fallback == "feature":
                s = replace(s, siblings=default_siblings(s.siblings))
        elif s.method == "suffix" and has_feature_head(saved, self.identity):
            fallback = "feature"  # one head token on rounds the store has no match for
        if s.exit_layer is None and (s.method in ("early-exit", "saguaro") or fallback == "early-exit"):
            s = replace(s, exit_layer=adapter_exit_layer(s.exit_adapter, saved) or self.default_exit_layer())
            s.validate(self.n_layers)
        store = self.suffix_store(tenant) if s.method == "suffix" else None
        return Resolved(s, self.identity, fallback, saved, store)

    def stream(self, prompt: str | Sequence[int], **options) -> Stream:
        """Start a generation; nothing runs until the stream is iterated. Errors in the arguments
        are raised here, before any model work. Options: see `prepare`."""
        p = self.prepare(prompt, **options)
        result = Generation(text="", tokens=[], stats=p.stats)
        rounds = decode(
            self.adapter, p.ids, p.drafter, sampling=p.sampling, max_new_tokens=p.max_new_tokens,
            eos_ids=p.eos_ids, stats=p.stats, prefix=p.prefix,
        )
        return Stream(self._chunks(rounds, result, p.stop), result)

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], *, max_batch: int = 8, **options) -> list[Generation]:
        """Generate for several prompts decoded together in one batch (continuous batching: see
        selfspec.core.batch); same options as `stream`, applied to every prompt. Each result is what
        `generate` gives for that prompt alone (greedy: token for token)."""
        from selfspec.core.batch import Scheduler

        scheduler = Scheduler(self.adapter, max_batch=max_batch, max_queue=len(prompts))
        results, errors = [], []
        for prompt in prompts:
            p = self.prepare(prompt, fresh_drafter=True, **options)
            result = Generation(text="", tokens=[], stats=p.stats)
            text = Detokenizer(self.tokenizer, p.stop)

            def on_tokens(tokens, result=result, text=text):
                result.tokens += tokens
                text.feed(tokens)
                result.text = text.text
                return not text.stopped

            scheduler.submit(p.request(on_tokens, on_done=lambda error: errors.append(error) if error else None))
            results.append(result)
        while scheduler.step():
            pass
        if errors:
            raise errors[0]
        return results


    def tuned(self, profile: str | None = None, exit_layer: int | None = None,
              draft_len: int | None = None) -> tuple[str, int | None, int | None]:
        """What method="auto" runs: (method, k, γ) from the profile's "tune" section, with the
        k and γ given here taking precedence. Without one: the choice shipped for this model and
        dtype where one was measured faster than AR (selfspec/data/shipped_profiles.json), else plain
        decoding (AR), never an unmeasured configuration (untrained early exit runs 0.4-0.8x AR on
        the bundled models); an exit layer or draft length given asks for early exit."""
        section = load_profile(self.identity, profile).get(TUNE_SECTION)
        stale = self._stale(section)
        if stale:
            if self.name not in _NOTED_UNTUNED:
                _NOTED_UNTUNED.add(self.name)
                warnings.warn(f"{self.name}'s tuned profile {stale}: --method auto ignores it; "
                              "`selfspec tune` measures again", stacklevel=4)
            section = None
        if not section:
            if exit_layer is not None or draft_len is not None:  # knobs of a draft: the user asks for one
                return "early-exit", exit_layer, draft_len
            shipped = shipped_choice(self.identity, self.dtype_name, self.adapter.device.type)
            # the CPU features the shipped choice was measured faster on, if it names them
            features = [gemv.PATH_NAMES.get(path, path) for path in (shipped or {}).get("kernel_paths") or []]
            if shipped is not None and not runs_here(shipped):
                choice = (f"plain decoding (the shipped {shipped['method']} for {self.dtype_name} was measured faster "
                          f"only on CPUs with {' or '.join(features)}; this one's products run on "
                          f"{gemv.PATH_NAMES[gemv.kernel_path()] if gemv.available() else 'PyTorch kernels'})")
                shipped = None
            else:
                where = f" on CPUs with {', '.join(features)}" if features else ""
                choice = ("plain decoding" if shipped is None else
                          f"the shipped choice for {self.dtype_name}, {shipped['method']} γ={shipped['draft_len']} "
                          f"(measured faster than plain decoding{where}; the figures are in "
                          "selfspec/data/shipped_profiles.json)")
            if self.name not in _NOTED_UNTUNED:
                _NOTED_UNTUNED.add(self.name)
                warnings.warn(f"{self.name} has no tuned profile on this machine: --method auto runs {choice}; "
                              f"`selfspec tune` measures which speculation is faster here", stacklevel=4)
            if shipped is None:
                return "ar", None, None
            return shipped["method"], shipped["exit_layer"], shipped["draft_len"]
        k = exit_layer if exit_layer is not None else section.get("exit_layer")
        g = draft_len if draft_len is not None else section.get("draft_len")
        return section["method"], k, g

    def _stale(self, section: dict | None) -> str | None:
        """Why a tuned section no longer applies (None: it does): measured by `selfspec tune` (it
        carries a "tuned" time) on an older engine, in another dtype or on another device type (a GPU's
        choice is not a CPU's: lookup ran 1.37x AR on an H200, the CPU's hybrid 0.36-0.54x there).
        Hand-written sections apply."""
        if not section or "tuned" not in section:
            return None
        if section.get("engine") != ENGINE:
            return f"was measured on an older decode engine (generation {section.get('engine', 1)}, now {ENGINE})"
        if section.get("dtype") not in (None, self.dtype_name):
            return f"was measured in {section['dtype']}, not {self.dtype_name}"
        device = self.adapter.device.type
        if section.get("device") not in (None, device):
            return f"was measured on {section['device']}, not {device}"
        return None

    def generate(self, prompt: str | Sequence[int], **options) -> Generation:
        """Run to the end; same options as `stream`."""
        stream = self.stream(prompt, **options)
        for _ in stream:
            pass
        return stream.result

    def _chunks(self, rounds: Iterator[list[int]], result: Generation, stop: list[str]) -> Iterator[Chunk]:
        """Turn committed token lists into text chunks, cutting at the first stop string."""
        text = Detokenizer(self.tokenizer, stop)
        try:
            for tokens in rounds:
                result.tokens += tokens
                shown = text.feed(tokens)
                result.text = text.text
                yield Chunk(tokens, shown)
                if text.stopped:
                    return
            rest = text.finish()
            if rest:
                yield Chunk([], rest)
        finally:
            rounds.close()


@dataclass
class Prepared:
    """A generation's resolved arguments (see SelfSpecModel.prepare)."""

    ids: torch.Tensor  # prompt token ids [n]
    drafter: Drafter
    sampling: SamplingParams
    max_new_tokens: int
    stop: list[str]
    stats: GenerationStats
    eos_ids: frozenset[int]
    prefix: object | None = None  # the PrefixStore this generation starts from and adds to

    def request(self, on_tokens, on_done):
        """This generation as a request for the batch scheduler (see selfspec.core.batch.Request for
        the two callbacks)."""
        from selfspec.core.batch import Request

        return Request(self.ids, self.drafter, self.sampling, self.max_new_tokens, self.stats,
                       on_tokens=on_tokens, on_done=on_done, eos_ids=self.eos_ids, prefix=self.prefix)


class Detokenizer:
    """Committed tokens in, text ready to show out: holds back what may still become a stop string
    or is an incomplete UTF-8 sequence, and cuts the text at the first stop string."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, list(stop)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""  # everything decoded so far, cut at a stop string
        self.shown = 0  # characters of text already returned
        self.stopped = False

    def feed(self, tokens: list[int]) -> str:
        """Add a round's tokens; return the new text that is safe to show."""
        self.tokens += tokens
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = _find_stop(text, self.stop, max(0, self.shown - self.holdback))
        if cut is not None:
            self.text, self.stopped = text[:cut], True
            return self._show(len(self.text))
        self.text = text
        ready = len(text) - self.holdback
        while ready > self.shown and text[ready - 1] == "\ufffd":  # an incomplete UTF-8 sequence
            ready -= 1
        return self._show(ready)

    def finish(self) -> str:
        """The generation ended: whatever text was held back."""
        return self._show(len(self.text))

    def _show(self, upto: int) -> str:
        if upto <= self.shown:
            return ""
        out, self.shown = self.text[self.shown : upto], upto
        return out


def _find_stop(text: str, stop: list[str], search_from: int) -> int | None:
    hits = [i for i in (text.find(s, search_from) for s in stop) if i >= 0]
    return min(hits) if hits else None


def load(
    model: str | None = None,
    *,
    dtype: str | torch.dtype = "auto",
    device: str = "cpu",
    progress: bool = True,
    compile: bool | None = None,
    exact: bool | None = None,
    lean: bool = True,
    head: str = "int8",
) -> SelfSpecModel:
    """Load a bundled model by name ("smollm2", the default; "gemma3"), a local Hugging Face
    checkpoint directory or a .gguf file.

    dtype: "auto" (bfloat16 where the device computes it natively, else float32; see
    `default_dtype`), float32, bfloat16, float16, int8 or int4 (weight-only, bfloat16 activations; see
    selfspec.model.quantize). compile: compile the decode step (None: `default_compile`). exact: every
    forward in one fixed row bucket, so greedy output is bit-identical to AR by construction (None:
    on for bfloat16 and int4, off otherwise; see `default_exact`). lean:
    False keeps the HF modules' weights exactly as loaded (training) and decodes on the general path.
    head: an int4 model's LM head, "int8" (the default) or "int4" (4-bit groups as its layers:
    fewer bytes a step, less fidelity; see selfspec.model.quantize.quantize_int4)."""
    if dtype == "auto":
        dtype = default_dtype(device, model)
        if dtype == "int4" and progress:
            print(f"selfspec: note: --dtype auto runs {model} in int4 (its GGUF's 4-bit weights through selfspec's "
                  "4-bit kernel); --dtype bfloat16 for 16-bit weights", file=sys.stderr)
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if head != "int8" and name != "int4":
        raise ValueError(f"--head-dtype {head} needs --dtype int4 (this model runs in {name})")
    quantize = {"int8": quantize_int8, "int4": quantize_int4}.get(dtype) if isinstance(dtype, str) else None
    if quantize is not None:
        if dtype == "int4" and torch.device(device).type != "cpu":
            raise ValueError("int4 runs PyTorch's CPU int4 kernel: on CUDA use --dtype int8 or bfloat16")
        dtype = ACTIVATION_DTYPE
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of: auto, {', '.join([*DTYPES, 'int8', 'int4'])}")
        dtype = DTYPES[dtype]
    if quantize is not None and torch.device(device).type == "cpu":
        # Quantized once per model and mode, then read back as such (selfspec.model.quantized_cache).
        loaded: LoadedModel = load_quantized(model, name, progress=progress, head=head)
    else:
        loaded = load_hf(model, dtype=dtype, device=device, progress=progress)
        if quantize is not None:
            quantize(loaded.model)
    if compile is None:
        compile = default_compile(device)
    if exact is None:
        exact = default_exact(name)
    return SelfSpecModel(loaded.model, loaded.tokenizer, loaded.name, lean=lean, compile=compile and lean,
                         exact=exact and lean, dtype_name=name)


DEFAULT_SIBLINGS = 2  # hybrid's feature fallback on CPUs with AMX: its two likeliest tokens as siblings


def default_siblings(asked: int | None = None) -> int:
    """Alternatives hybrid's feature fallback drafts (Draft.siblings): `asked` if given, else DEFAULT_SIBLINGS where the
    products run on AMX, whose 3-row verify costs ~1.07 steps (2-core Intel Xeon: the hybrid
    1.24x -> 1.28x AR on the benchmark prompts, 1.53x -> 1.57x on tune's; README "Siblings"), else
    1 (a chain: the pair products' 3-row verify costs 1.17-1.27 steps, unmeasured with siblings)."""
    if asked:
        return asked
    return DEFAULT_SIBLINGS if gemv.kernel_path() == "amx" and gemv.available() else 1


def has_feature_head(profile: dict, identity: ModelIdentity) -> bool:
    """Whether the model has a feature head: its profile names one, or one is shipped for it."""
    from selfspec.heads.feature_head import SECTION, shipped_path

    return bool(profile.get(SECTION) or shipped_path(identity).is_file())


def exact_limit_here() -> int | None:
    """The most rows exact mode can verify on this machine for a model the fused layer runs
    (SelfSpecModel.exact_limit says it for one model): before any model loads."""
    from selfspec.native import gemv

    return None if gemv.available() else EXACT_ROWS


def check_exact_draft(draft_len: int, rows: int | None = EXACT_ROWS) -> None:
    """Exact mode verifies the pending token and at most rows - 1 drafts (SelfSpecModel.exact_limit;
    None: any)."""
    if rows is not None and draft_len + 1 > rows:
        raise ValueError(f"exact mode verifies at most {rows} rows here: the draft length must be at most "
                         f"{rows - 1}, got {draft_len} (lower -g, or turn exact mode off: --no-exact / exact=False)")


def default_dtype(device: str = "cpu", model: str | None = None) -> str:
    """int4 for the bundled models that say so (the Qwen2.5-Coder ones: selfspec.model.loading's
    auto_dtype) on a CPU where selfspec's kernels build: their 4-bit step streams a third of
    bfloat16's bytes through selfspec's 4-bit kernel in the fused layer (docs/performance.md).
    Otherwise bfloat16 on CUDA, on CPUs with native bfloat16 arithmetic (AVX512-BF16 or AMX), and where
    selfspec's own product kernel runs (x86 with AVX2 and g++): a step reads half float32's bytes,
    and a prefill's products widen to float32 where bfloat16 is emulated (selfspec.model.wide_product).
    On a 2-core AMD EPYC with AVX2 only, plain decoding ran 25.3 tok/s in bfloat16 against 17.2 in
    float32 on the bench prompts (README, "A fourth CPU"). float32 elsewhere (no kernel: PyTorch's
    emulated bfloat16 products are slow)."""
    if torch.device(device).type == "cuda":
        return "bfloat16"
    from selfspec.model.loading import auto_dtype

    if auto_dtype(model) == "int4" and gemv.available():
        return "int4"
    return "bfloat16" if gemv.native_bfloat16() or gemv.available() else "float32"


def default_exact(dtype: str) -> bool:
    """Exact mode unless asked otherwise: bfloat16, whose 4-row products cost about one row's on
    the CPUs measured, and int4, whose speed is the point of it and whose default mode left AR's
    output at near ties on 5 of 6 bench prompts here (README, "The lean step")."""
    return dtype in ("bfloat16", "int4")


def default_compile(device: str) -> bool:
    """Whether the decode step is compiled by default: where it was measured faster (README)."""
    return COMPILE_BY_DEFAULT.get(torch.device(device).type, False)
