"""The int8 and int4 models on disk, so that quantizing happens once per model and mode.

A quantized load reads the dense bfloat16 weights and quantizes every layer (most of a minute for
Qwen2.5-Coder 1.5B on 2 cores). The first one saves the result beside the checkpoint: one
safetensors file per mode (int4 also per layout), holding the quantized modules' tensors, every
other parameter and buffer of the model, and in its metadata which module is what (an Int4Linear,
an Int4Slice of a fused one, an Int8Linear, with an int8 head's screen). The embedding is stored as its int8 rows (the head's,
where they are tied; selfspec.model.quantize.quantize_embedding), and its bfloat16 table is
computed from them on load. A later load builds the model's skeleton from its
config on the meta device, puts the modules back and assigns the tensors: no dense weights are
read and nothing is quantized, and the model equals the freshly quantized one bit for bit.

The file is trusted only if its key matches: FORMAT, the mode, the int4 layout, a digest of
the source of selfspec.model.quantize and head_screen, and the torch and transformers versions (PyTorch's int4 packing
is its own). Anything else quantizes afresh and overwrites it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from selfspec.model import quantize as quantize_module
from selfspec.model.loading import (
    DEFAULT_MODEL,
    LoadedModel,
    _quiet,
    conversion_target,
    converted_for,
    display_name,
    drop_weights,
    is_converted,
    load_hf,
    resolve_checkpoint,
)
from selfspec.model import head_screen
from selfspec.model.quantize import (
    ACTIVATION_DTYPE,
    EMBEDDING_INT8,
    HEADS,
    Int4Linear,
    Int4Slice,
    Int8Linear,
    default_int4_layout,
    dequantize_rows,
    quantize_int4,
    quantize_int8,
)
from selfspec.native.build import cache_root

FORMAT = 3  # of the file: bump when what is saved, or how it is read back, changes (2: the embedding as int8 rows; 3: the head's screen)
QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int4}


def file_name(mode: str, head: str = "int8") -> str:
    if mode != "int4":
        return f"selfspec-{mode}.safetensors"
    return f"selfspec-int4-{default_int4_layout()}{'-head4' if head == 'int4' else ''}.safetensors"


def key(mode: str, head: str = "int8") -> dict[str, str]:
    """What a saved file must have been made with to be read back as this mode's model (head: an
    int4 model's head, quantize.quantize_int4's)."""
    import transformers

    source = b"".join(Path(m.__file__).read_bytes() for m in (quantize_module, head_screen))
    return {
        "format": str(FORMAT),
        "mode": mode,
        "head": head,  # int8 outside int4 (load_quantized refuses another)
        "layout": default_int4_layout() if mode == "int4" else "",
        "quantizer": hashlib.sha256(source).hexdigest()[:16],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def load_quantized(
    name_or_path: str | None, mode: str, *, cache: Path | None = None, progress: bool = True, head: str = "int8"
) -> LoadedModel:
    """`mode` ("int8" or "int4") of a model on the CPU: read from its quantized file when there is
    a current one, else loaded in bfloat16, quantized and saved there. A converted GGUF keeps its
    dense weights only if a dense load had already written them. head: an int4 model's LM head,
    "int8" or "int4" (quantize.quantize_int4)."""
    from transformers import AutoTokenizer

    if mode not in QUANTIZERS:
        raise ValueError(f"mode must be one of {', '.join(QUANTIZERS)}, not {mode!r}")
    if head not in HEADS or (head != "int8" and mode != "int4"):
        raise ValueError(f"the head is int8, or int4 in an int4 model; not {head!r} in {mode}")
    name_or_path = name_or_path or DEFAULT_MODEL
    target = conversion_target(name_or_path, cache)
    keep_dense = target is None or converted_for(target, ACTIVATION_DTYPE)  # the user's, or a dense load's
    checkpoint = resolve_checkpoint(name_or_path, cache=cache, progress=progress, dtype=None)
    path = home(checkpoint, cache) / file_name(mode, head)
    model = read(path, checkpoint, mode, head)
    if model is None:
        model = load_hf(name_or_path, dtype=ACTIVATION_DTYPE, cache=cache, progress=progress).model
        if progress:
            print(f"quantizing {display_name(name_or_path, checkpoint)} to {mode} (once) into {path}", file=sys.stderr)
        start = time.perf_counter()
        QUANTIZERS[mode](model, **({"head": head} if mode == "int4" else {}))
        model.eval()  # the new modules too, as a read-back model is
        try:
            saved = write(model, path, mode, head)
        except OSError as err:  # a read-only or full cache: run without saving
            print(f"could not save the {mode} model to {path}: {err}", file=sys.stderr)
            saved = False
        if progress and saved:
            size = path.stat().st_size / 1e9
            print(f"quantized and saved in {time.perf_counter() - start:.0f} s ({size:.2f} GB)", file=sys.stderr)
        if saved and not keep_dense:
            drop_weights(checkpoint)  # written only to quantize from; the file above is what runs
        _release_rows(model)
    with _quiet(True):
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return LoadedModel(model=model, tokenizer=tokenizer, name=display_name(name_or_path, checkpoint), path=checkpoint)


def home(checkpoint: Path, cache: Path | None = None) -> Path:
    """Where a model's quantized files live: beside a converted checkpoint, in the cache for a
    checkpoint directory of the user's (keyed by its path and its files' sizes and times)."""
    if is_converted(checkpoint):
        return checkpoint
    root = Path(cache) if cache is not None else cache_root()
    stamp = [str(checkpoint.resolve())]
    for file in sorted(checkpoint.iterdir()):
        if file.is_file():
            stat = file.stat()
            stamp.append(f"{file.name}\0{stat.st_size}\0{stat.st_mtime_ns}")
    digest = hashlib.sha256("\0\0".join(stamp).encode()).hexdigest()[:10]
    return root / "quantized" / f"{checkpoint.name}-{digest}"


# -- the file -----------------------------------------------------------------------------------


def write(model: torch.nn.Module, path: Path, mode: str, head: str = "int8") -> bool:
    """Save a quantized model's tensors and structure to `path`, atomically. False (nothing saved)
    when the model holds a module this file cannot describe."""
    from safetensors.torch import save_file

    modules, tensors = _describe(model)
    if modules is None:
        return False
    derived = _derived_embedding(model, modules, tensors)
    names: dict[int, str] = {}  # id(tensor) -> the name it is stored under
    ties: dict[str, str] = {}  # a further name of a tensor -> the name it is stored under
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if _owner(name, modules) is not None or (derived and name == derived["embedding"]):
            continue
        if id(tensor) in names:
            ties[name] = names[id(tensor)]
        else:
            names[id(tensor)] = name
            tensors[name] = tensor.detach()
    metadata = {**key(mode, head), "modules": json.dumps(modules), "ties": json.dumps(ties),
                "derived": json.dumps(derived)}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.partial-")
    os.close(fd)
    try:
        save_file({name: t.contiguous() for name, t in tensors.items()}, partial, metadata=metadata)
        os.chmod(partial, 0o644)  # mkstemp makes it private; the cache may be shared between users
        os.replace(partial, path)
    finally:
        Path(partial).unlink(missing_ok=True)
    return True


def read(path: Path, checkpoint: Path, mode: str, head: str = "int8") -> torch.nn.Module | None:
    """The quantized model saved at `path` for the checkpoint at `checkpoint`, or None if there is
    no file or it was made with another key."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    try:
        metadata, tensors = _read_file(path, key(mode, head))
    except (OSError, ValueError, KeyError):
        return None
    if tensors is None:
        return None
    config = AutoConfig.from_pretrained(checkpoint)
    with _quiet(True), torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=ACTIVATION_DTYPE, attn_implementation="sdpa")
    modules = json.loads(metadata["modules"])
    built: dict[str, torch.nn.Module] = {}
    for name, entry in modules.items():  # in the order _describe wrote them: a fused module before its slices
        bias = tensors.pop(f"{name}.bias", None)
        if entry["type"] == "Int4Linear":
            module = Int4Linear(tensors.pop(f"{name}.packed"), tensors.pop(f"{name}.scales_zeros"), bias)
        elif entry["type"] == "Int4Slice":
            module = Int4Slice(built[entry["fused"]], entry["start"], entry["stop"], bias)
        else:
            module = Int8Linear(tensors.pop(f"{name}.weight"), tensors.pop(f"{name}.scale"), bias)
            if f"{name}.screen.bounds" in tensors:
                approx = Int4Linear(tensors.pop(f"{name}.screen.packed"), tensors.pop(f"{name}.screen.scales_zeros"), None)
                module.screen = head_screen.HeadScreen(approx, tensors.pop(f"{name}.screen.bounds"))
        built[name] = module
        if entry.get("attached", True):
            model.set_submodule(name, module, strict=True)
    for name, tensor in tensors.items():
        if not name.startswith(EMBEDDING + "."):
            _assign(model, name, tensor)
    for name, first in json.loads(metadata["ties"]).items():
        _assign(model, name, tensors[first])
    derived = json.loads(metadata.get("derived") or "null")
    if derived and derived["head"]:  # the embedding's int8 rows are the head's (quantize.quantize_embedding)
        head = built[derived["head"]]
        setattr(model, EMBEDDING_INT8, (head.weight, head.scale))  # the head's own tensors: no memory of their own
        _assign(model, derived["embedding"], dequantize_rows(head.weight, head.scale, ACTIVATION_DTYPE))
    elif derived:  # stored beside the modules
        q, scale = tensors[f"{EMBEDDING}.weight"], tensors[f"{EMBEDDING}.scale"]
        _assign(model, derived["embedding"], dequantize_rows(q, scale, ACTIVATION_DTYPE))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"{path} does not hold {', '.join(left[:3])}; delete it to quantize afresh")
    if (checkpoint / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(checkpoint)
    return model.eval().requires_grad_(False)


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _read_file(path: Path, expected: dict[str, str]) -> tuple[dict[str, str], dict[str, torch.Tensor] | None]:
    """(metadata, tensors) of a safetensors file; tensors None if the metadata does not match
    `expected`. Each tensor is read into its own allocation (aligned, as PyTorch's int8 kernel
    needs), with one read call, which is faster than faulting in a memory map and copying."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        metadata = header.pop("__metadata__", None) or {}
        if any(metadata.get(k) != v for k, v in expected.items()):
            return metadata, None
        base = 8 + size
        tensors = {}
        for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            tensor = torch.empty(info["shape"], dtype=_DTYPES[info["dtype"]])
            start, stop = info["data_offsets"]
            if stop > start:
                f.seek(base + start)
                if f.readinto(tensor.view(-1).view(torch.uint8).numpy()) != stop - start:
                    raise ValueError(f"{path} is truncated")
            tensors[name] = tensor
    return metadata, tensors


def _describe(model: torch.nn.Module) -> tuple[dict | None, dict[str, torch.Tensor]]:
    """({module name: what it is}, its tensors) for the quantized modules of `model`; (None, {})
    if a module is neither one of those nor what the model's own class builds at that place."""
    from transformers import AutoModelForCausalLM

    with _quiet(True), torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(model.config, dtype=ACTIVATION_DTYPE, attn_implementation="sdpa")
    expected = {name: type(m) for name, m in skeleton.named_modules()}
    modules: dict[str, dict] = {}
    tensors: dict[str, torch.Tensor] = {}
    fused: dict[int, str] = {}  # id(Int4Linear) -> its name

    def add_tensors(name: str, **named: torch.Tensor | None) -> None:
        tensors.update({f"{name}.{k}": t.detach() for k, t in named.items() if t is not None})

    for name, module in model.named_modules(remove_duplicate=False):
        if _owner(name, modules) is not None:
            continue
        if isinstance(module, Int4Slice):
            if id(module.fused) not in fused:  # the fused module, saved first, under its own name
                fused[id(module.fused)] = f"{name}.fused"
                modules[f"{name}.fused"] = {"type": "Int4Linear", "attached": False}
                add_tensors(f"{name}.fused", packed=module.fused.packed, scales_zeros=module.fused.scales_zeros,
                            bias=module.fused.bias)
            modules[name] = {"type": "Int4Slice", "fused": fused[id(module.fused)], "start": module.start,
                             "stop": module.stop}
            add_tensors(name, bias=module.bias)
        elif isinstance(module, Int4Linear):
            modules[name] = {"type": "Int4Linear"}
            add_tensors(name, packed=module.packed, scales_zeros=module.scales_zeros, bias=module.bias)
        elif isinstance(module, Int8Linear):
            modules[name] = {"type": "Int8Linear"}
            add_tensors(name, weight=module.weight, scale=module.scale, bias=module.bias)
            screen = getattr(module, "screen", None)  # a head's (selfspec.model.head_screen)
            if screen is not None:
                add_tensors(f"{name}.screen", packed=screen.approx.packed, scales_zeros=screen.approx.scales_zeros,
                            bounds=screen.bounds)
        elif expected.get(name) is not type(module):
            return None, {}
    return modules, tensors


EMBEDDING = "selfspec_embedding"  # where an untied embedding's int8 rows are stored


def _release_rows(model: torch.nn.Module) -> None:
    """Drop an untied embedding's int8 rows once saved: only the file needs them (the 1.5B's are
    0.23 GB); a tied embedding's are the head's and stay."""
    rows = getattr(model, EMBEDDING_INT8, None)
    head = model.get_output_embeddings()
    if rows is not None and not (isinstance(head, Int8Linear) and rows[0] is head.weight):
        delattr(model, EMBEDDING_INT8)


def _derived_embedding(model: torch.nn.Module, modules: dict, tensors: dict) -> dict | None:
    """Where the model holds its embedding as int8 rows (quantize.quantize_embedding): {"embedding":
    its parameter's name, "head": the Int8Linear's name when they are the head's}, adding untied
    rows to `tensors` under EMBEDDING; the bfloat16 table itself is then not stored. Else None."""
    rows = getattr(model, EMBEDDING_INT8, None)
    if rows is None:
        return None
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    name = next((n for n, p in model.named_parameters(remove_duplicate=False) if p is embedding.weight), None)
    if name is None:
        return None
    head_name = next((n for n, m in model.named_modules() if m is head), None)
    if isinstance(head, Int8Linear) and rows[0] is head.weight and head_name in modules:
        return {"embedding": name, "head": head_name}
    tensors[f"{EMBEDDING}.weight"], tensors[f"{EMBEDDING}.scale"] = rows[0].detach(), rows[1].detach()
    return {"embedding": name, "head": None}


def _owner(name: str, modules: dict) -> str | None:
    """The quantized module that `name` (a module's, parameter's or buffer's) is inside, if any."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in modules:
            return prefix
    return None


def _assign(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    parent, _, attr = name.rpartition(".")
    module = model.get_submodule(parent)
    if attr in module._parameters:
        module._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
    elif attr in module._buffers:
        module._buffers[attr] = tensor
    else:
        raise KeyError(f"the model has no parameter or buffer {name!r}")
