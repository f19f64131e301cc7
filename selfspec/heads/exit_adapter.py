"""The exit adapter: a tiny trained map from the exit layer's hidden state to the model's final one.

Plain early exit at k drafts with head(h_k): the model's own final norm and LM head applied to the
hidden state after layers 0 .. k-1. An exit adapter A (trained by `selfspec calibrate`, the base
model frozen) predicts the full model's final hidden state (before the final norm) from h_k, and
the draft uses head(A(h_k)) instead. Only the draft changes: the verify still runs the full model
from the raw h_k, so output stays exactly the full model's.

A is a residual MLP, h + W2·act(W1·norm(h)), with W2 zero-initialised: untrained, A is the
identity and the draft is plain early exit. Width d (the hidden size) gives 2·d² + d parameters,
0.66M for SmolLM2-135M (d = 576), about 0.5% of the model.

On disk: one safetensors file per (model, k), whose metadata holds a JSON header tying it to the
model's identity (name and config hash, as profiles are), beside the model's profile:
`profiles_dir()/<identity slug>.exit-k<k>.safetensors`. The profile's "exit-adapter" section
points at the one `generate`, `bench` and the server use when their k matches it, unless its
"context-head" section names a context head (selfspec.heads.context_head) for that k: the option that
selects an adapter (`exit_adapter`, `--exit-adapter FILE|none`) selects either kind.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from selfspec.heads import context_head, tagged_file
from selfspec.heads.context_head import ContextHead
from selfspec.model.profiles import ModelIdentity, profiles_dir

SECTION = "exit-adapter"  # the profile section naming this model's adapter
FORMAT = "selfspec-exit-adapter/1"
DISABLED = (False, "none")  # values of the exit_adapter option that turn the adapter off


class ExitAdapter(torch.nn.Module):
    """h_k [..., d] -> predicted final hidden state [..., d]: h + W2·silu(W1·rmsnorm(h))."""

    def __init__(self, hidden_size: int, exit_layer: int, width: int | None = None, eps: float = 1e-6):
        super().__init__()
        if exit_layer < 1:
            raise ValueError(f"exit layer k must be >= 1, got {exit_layer}")
        width = hidden_size if width is None else width
        if width < 1:
            raise ValueError(f"adapter width must be >= 1, got {width}")
        self.exit_layer = exit_layer
        self.hidden_size = hidden_size
        self.width = width
        self.norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        self.up = torch.nn.Linear(hidden_size, width, bias=False)
        self.down = torch.nn.Linear(width, hidden_size, bias=False)
        torch.nn.init.zeros_(self.down.weight)  # untrained = identity = plain early exit

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.silu(self.up(self.norm(h))))

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def default_path(identity: ModelIdentity, exit_layer: int, directory: str | Path | None = None) -> Path:
    directory = profiles_dir() if directory is None else Path(directory)
    return directory / f"{identity.slug()}.exit-k{exit_layer}.safetensors"


def save_exit_adapter(adapter: ExitAdapter, path: str | Path, identity: ModelIdentity,
                      training: dict | None = None) -> Path:
    """Write the adapter's weights (float32) and header atomically; `training` is a summary
    (α before/after, steps, positions, ...) kept in the header for whoever inspects the file."""
    header = dict(format=FORMAT, identity=asdict(identity), exit_layer=adapter.exit_layer,
                  hidden_size=adapter.hidden_size, width=adapter.width, dtype="float32",
                  training=training or {})
    return tagged_file.write_module(path, adapter, header)


def read_header(path: str | Path) -> dict:
    """The JSON header of an adapter file, without loading its weights."""
    return tagged_file.read_header(path, FORMAT, f"no exit adapter at {path}", "exit adapter")


def load_exit_adapter(path: str | Path, identity: ModelIdentity) -> ExitAdapter:
    """The adapter in `path`, refused unless it was trained for this model."""
    header = read_header(path)
    tagged_file.check_identity(header, identity, path, "exit adapter")
    adapter = ExitAdapter(header["hidden_size"], header["exit_layer"], header["width"])
    adapter.load_state_dict(load_file(str(path)))
    return adapter.eval().requires_grad_(False)


def chosen_path(choice, profile: dict, exit_layer: int | None, context: bool = True) -> Path | None:
    """Which trained file the exit_adapter option `choice` selects: None (the default) picks the
    profile's context head (selfspec.heads.context_head), else its exit adapter, whose k is
    `exit_layer` (or any k when `exit_layer` is None); False or "none" picks none; anything else is
    a path. context=False: never the profile's context head (a drafter that cannot use one)."""
    if choice in DISABLED:
        return None
    if choice is not None:
        return Path(choice).expanduser()
    section = profile_section(profile, exit_layer, context)
    return None if section is None else Path(section["path"])


def profile_section(profile: dict, exit_layer: int | None, context: bool = True) -> dict | None:
    """The profile's section naming a trained draft at `exit_layer` (None: any k): the context
    head's first, since it drafts better than the per-position adapter."""
    for name in (context_head.SECTION, SECTION) if context else (SECTION,):
        section = profile.get(name)
        if section and (exit_layer is None or section.get("exit_layer") == exit_layer):
            return section
    return None


def read_any_header(path: str | Path) -> dict:
    """The header of an exit adapter or a context head file (its "format" says which)."""
    return tagged_file.read_header(path, (FORMAT, context_head.FORMAT), f"no exit adapter at {path}", "exit adapter")


def adapter_exit_layer(choice, profile: dict) -> int | None:
    """k of the adapter `choice` selects regardless of k (the default k of early exit when the user
    gives none), None when there is none."""
    if choice in DISABLED:
        return None
    if choice is None:
        section = profile_section(profile, None)
        return None if section is None else section["exit_layer"]
    return read_any_header(Path(choice).expanduser())["exit_layer"]


def exit_adapter_for(choice, profile: dict, identity: ModelIdentity | None, exit_layer: int | None,
                     context: bool = True) -> ExitAdapter | ContextHead | None:
    """Load the exit adapter or context head `choice` selects (see chosen_path) for early exit at
    `exit_layer`. An explicit file trained for another k is an error; the profile's is simply not
    used then. context=False: a context head is refused (explicit) or passed over (the profile's)."""
    path = chosen_path(choice, profile, exit_layer, context)
    if path is None:
        return None
    if identity is None:
        raise ValueError("loading an exit adapter needs the model's identity, to check the file belongs to it")
    if choice is None and not path.is_file():
        raise FileNotFoundError(f"the profile names exit adapter {path}, which is missing; run `selfspec calibrate` "
                                f"again or pass exit_adapter='none' (--exit-adapter none)")
    if read_any_header(path)["format"] == context_head.FORMAT:
        if not context:
            raise ValueError(f"{path} is a context head, which this method cannot draft with; give an exit "
                             f"adapter file or 'none'")
        adapter = tagged_file.shared(context_head.load_context_head, path, identity)
    else:
        adapter = tagged_file.shared(load_exit_adapter, path, identity)
    if exit_layer is not None and adapter.exit_layer != exit_layer:
        raise ValueError(f"exit adapter {path} was trained for k={adapter.exit_layer}, not k={exit_layer}; "
                         f"use -k {adapter.exit_layer} or calibrate k={exit_layer}")
    return adapter
