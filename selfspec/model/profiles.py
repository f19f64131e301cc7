"""Profiles: what offline search and tuning found for one model, as plain JSON.

A profile is tied to the model's identity, its name and a hash of its architecture config, so a
profile found for one model is never silently used with another. One file per model under
`cache_root()/profiles/` (or $SELFSPEC_PROFILES), one section per method (e.g. "layer-skip" from `selfspec search`):

    {"format": 1, "identity": {"name": ..., "config_hash": ...},
     "layer-skip": {"skip": {"attn": [...], "mlp": [...]}, ...}}
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from selfspec.model.file_cache import FileCache
from selfspec.native.build import cache_root

FORMAT = 1
# Config keys that do not change what the layers compute: left out of the hash.
_VOLATILE = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures", "use_cache",
             "_attn_implementation_autoset", "attn_implementation", "output_attentions", "output_hidden_states"}


TUNE_SECTION = "tune"  # the profile section `selfspec tune` writes
# The decode engine's generation. A tuned choice is a measurement of this engine: when the engine
# changes what a step, a draft and a verify cost (2: the fused layer, which made AR ~1.6x faster
# and a 4-row verify relatively dearer), choices tuned on an older one no longer say what wins.
ENGINE = 2


class ProfileMismatchError(ValueError):
    pass


@dataclass(frozen=True)
class ModelIdentity:
    name: str
    config_hash: str  # sha256 of the architecture config, first 16 hex digits

    @classmethod
    def of(cls, hf_model, name: str) -> ModelIdentity:
        config = hf_model.config.to_dict()
        kept = {k: v for k, v in sorted(config.items()) if k not in _VOLATILE}
        digest = hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]
        return cls(name=name, config_hash=digest)

    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "_", self.name).strip("_") + "-" + self.config_hash


def profiles_dir() -> Path:
    """$SELFSPEC_PROFILES, else cache_root()/profiles."""
    if os.environ.get("SELFSPEC_PROFILES"):
        return Path(os.environ["SELFSPEC_PROFILES"]).expanduser()
    return cache_root() / "profiles"


def profile_path(identity: ModelIdentity) -> Path:
    return profiles_dir() / f"{identity.slug()}.json"


def load_profile(identity: ModelIdentity, path: str | Path | None = None) -> dict:
    """The profile of this model ({} if there is none at the default place). An explicit `path`
    must exist and must belong to this model."""
    explicit = path is not None
    path = Path(path) if explicit else profile_path(identity)
    if not path.is_file():
        if explicit:
            raise FileNotFoundError(f"no profile at {path}")
        return {}
    try:
        data = copy.deepcopy(_profiles.get(path, _read_json))  # callers may change their copy
    except json.JSONDecodeError as err:
        raise ValueError(f"profile {path} is not valid JSON ({err}); delete it or run the search again") from None
    found = data.get("identity", {})
    if data.get("format") != FORMAT or found != asdict(identity):
        raise ProfileMismatchError(
            f"profile {path} belongs to {found.get('name')!r} (config {found.get('config_hash')}), not to "
            f"{identity.name!r} (config {identity.config_hash}); run the search for this model"
        )
    return data


def save_section(identity: ModelIdentity, section: str, content: dict, path: str | Path | None = None) -> Path:
    """Write (or replace) one method's section of this model's profile, atomically."""
    path = Path(path) if path is not None else profile_path(identity)
    data = load_profile(identity, path) if path.is_file() else {}
    data.update(format=FORMAT, identity=asdict(identity))
    data[section] = content
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
    return path


def shipped_choice(identity: ModelIdentity, dtype: str | None, device: str = "cpu") -> dict | None:
    """The configuration shipped in selfspec/data/shipped_profiles.json for this model, dtype and
    device type (method, exit_layer, draft_len, measured), or None: what `auto` runs before any
    tune here. Entries keyed by the dtype alone were measured on CPUs; "dtype@cuda" on a GPU."""
    table = _shipped_table()
    key = dtype or ""
    return copy.deepcopy(table.get(identity.slug(), {}).get(key if device == "cpu" else f"{key}@{device}"))


@functools.cache
def _shipped_table() -> dict:
    from importlib import resources

    return json.loads(resources.files("selfspec").joinpath("data/shipped_profiles.json").read_text())


_profiles = FileCache(32)  # profile contents, read once while unchanged (selfspec.model.file_cache)


def _read_json(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def runs_here(choice: dict) -> bool:
    """Whether a shipped choice applies on this machine. An entry that names "kernel_paths" was
    measured faster than plain decoding only where selfspec's product kernel runs one of those
    paths (selfspec.native.gemv.kernel_path): on a CPU with AVX2 only, a bfloat16 verify over 2 rows
    costs ~1.15 steps and the shipped hybrid ran 0.99x AR (README, "A fourth CPU"); on an Ice
    Lake Xeon's AVX-512 path it ran 1.11x (README, "A fifth CPU")."""
    paths = choice.get("kernel_paths")
    if paths is None:
        return True
    from selfspec.native import gemv

    return gemv.available() and gemv.kernel_path() in paths
