"""The forward `selfspec train` runs: the model's own decoder layers (transformers' body module),
with hooks that apply layer dropout and keep the hidden states the exits read, and the exits'
logits through the model's own final norm and LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from selfspec.tools.train.data import Batch


class Exits:
    """Forward hooks on every decoder layer of the HF model: layer dropout, and keeping the hidden
    states that exits read. The forward itself is the model's own (transformers' body module), so
    training runs wherever the model does; outside `with`, the model is untouched.

    keep: the exits k whose input (the output of layer k-1) is kept in `states`."""

    def __init__(self, layers: torch.nn.ModuleList):
        self.layers = layers
        self.device = next(layers.parameters()).device
        self.drop: torch.Tensor | None = None  # [L, batch] bool on the model's device; see `dropout`
        self.skips: list[bool] | None = None  # per layer: is it dropped for any row (known without a device sync)
        self.keep: set[int] = set()
        self.states: dict[int, torch.Tensor] = {}  # k -> [batch, seq, hidden]
        self._handles = []

    def dropout(self, draw: torch.Tensor | None) -> None:
        """This step's layer dropout: draw [L, batch] bool on the CPU, True = that layer returns its
        input for that row (skipped whole: its output is computed and discarded, which costs the mean
        rate, about 0.44·p_max, of the layers' time and keeps the batch in one kernel call); None: off."""
        self.skips = None if draw is None else draw.any(1).tolist()
        self.drop = None if draw is None else draw.to(self.device)

    def __enter__(self) -> Exits:
        self._handles = [layer.register_forward_hook(self._hook(i), with_kwargs=True)
                         for i, layer in enumerate(self.layers)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self.states = [], {}

    def _hook(self, i: int):
        def hook(module, args, kwargs, output):
            out = output[0] if isinstance(output, tuple) else output
            changed = self.skips is not None and self.skips[i]
            if changed:
                h_in = args[0] if args else kwargs["hidden_states"]
                out = torch.where(self.drop[i].view(-1, 1, 1), h_in, out)
            if i + 1 in self.keep:
                self.states[i + 1] = out
            if changed:
                return (out, *output[1:]) if isinstance(output, tuple) else out
            return None
        return hook


def exit_logits(adapter, h: torch.Tensor) -> torch.Tensor:
    """The model's shared final norm and LM head on hidden states [b, n, hidden]: [b, n, vocab] float32."""
    logits = adapter.lm_head(adapter.norm(h)).float()
    if adapter.final_softcap is not None:
        logits = torch.tanh(logits / adapter.final_softcap) * adapter.final_softcap
    return logits


def exit_forward(adapter, exits: Exits, batch: Batch, ks) -> dict[int, torch.Tensor]:
    """One forward of the model's body; each exit k in `ks` -> its logits [b, n, vocab]."""
    exits.keep, exits.states = set(ks), {}
    adapter.hf_model.model(input_ids=batch.ids, attention_mask=batch.mask, use_cache=False)
    return {k: exit_logits(adapter, exits.states[k]) for k in ks}


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
