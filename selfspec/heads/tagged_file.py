"""Small safetensors files whose metadata carries a JSON header saying what they are and which
model they belong to: exit adapters (selfspec.heads.exit_adapter) and draft-head rankings
(selfspec.heads.draft_head), context heads (selfspec.heads.context_head). Written atomically; the header is read without loading the tensors."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from selfspec.model.file_cache import FileCache

HEADER_KEY = "selfspec"  # the safetensors metadata entry holding the JSON header


def write(path: str | Path, tensors: dict[str, torch.Tensor], header: dict) -> Path:
    """Write tensors and header to `path` through a temporary file, so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={HEADER_KEY: json.dumps(header)})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def write_module(path: str | Path, module: torch.nn.Module, header: dict) -> Path:
    """`write` a trained module's saved state in float32 (its header says dtype float32)."""
    tensors = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in module.state_dict().items()}
    return write(path, tensors, header)


def read_header(path: str | Path, format_: str | tuple[str, ...], missing: str, what: str) -> dict:
    """The header of the file at `path`, which must be of `format_` (or one of them). `missing`: the
    error when there is no file; `what`: the kind of file, for the error when it is another kind."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(missing)
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path} is not a safetensors file ({err})") from None
    try:
        header = json.loads(metadata[HEADER_KEY])
    except (KeyError, json.JSONDecodeError):
        header = {}
    formats = (format_,) if isinstance(format_, str) else format_
    if header.get("format") not in formats:
        raise ValueError(f"{path} is not a selfspec {what} (no '{formats[0]}' header); make one with `selfspec calibrate`")
    return header


def check_identity(header: dict, identity, path: str | Path, what: str, remedy: str = "`selfspec calibrate`") -> None:
    """Refuse a file made for another model (name and config hash, as profiles are keyed)."""
    from selfspec.model.profiles import ProfileMismatchError

    found = header.get("identity", {})
    if found != asdict(identity):
        raise ProfileMismatchError(
            f"{what} {path} belongs to {found.get('name')!r} (config {found.get('config_hash')}), not to "
            f"{identity.name!r} (config {identity.config_hash}); run {remedy} for this model"
        )


SHARED_MAX = 16  # distinct head files kept loaded at once (a process rarely drafts with more)
_shared = FileCache(SHARED_MAX)


def shared(loader, path: str | Path, identity):
    """`loader(path, identity)`, read from disk once and then shared while the file is unchanged
    (same size and modification time): drafting only reads a head's weights, so every drafter of a
    model (each of a server's requests) uses one copy. Training loads its own copy with the loader."""
    return _shared.get(path, loader, identity)
