"""int8 weight-only quantization: each decoder layer's linear weights as int8 with one scale per
output channel, multiplied by PyTorch's own int8 weight-only kernel (`_weight_int8pack_mm`).

Activations stay in the model's float dtype (bfloat16); a matrix product reads a quarter of the
float32 bytes, which is what a memory-bound decode step costs. Embeddings, norms and the LM head
keep their float weights (the head is tied to the embedding in the bundled models). Draft and
verify run the same quantized model, so self-speculative output stays identical to this int8
model's own AR output; it is not float32's output.
"""

from __future__ import annotations

import torch

# The activation dtype int8 weights run with: the kernel takes bfloat16 or float32 inputs, and
# bfloat16 keeps the activations' bytes small too.
ACTIVATION_DTYPE = torch.bfloat16


class Int8Linear(torch.nn.Module):
    """y = x · (w_int8 · scale)ᵀ + bias, w_int8 [out, in] int8, scale [out] in x's dtype."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.scale = torch.nn.Parameter(scale, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, dtype: torch.dtype) -> "Int8Linear":
        w = linear.weight.detach().float()
        # Symmetric per-channel: the largest |w| of each output row maps to 127.
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach().to(dtype)
        return cls(q, scale.to(dtype), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.weight, self.scale, self.bias)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    shape = x.shape
    y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]).contiguous(), weight, scale)
    y = y.view(*shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


def quantize_int8(hf_model: torch.nn.Module) -> int:
    """Replace every nn.Linear inside the decoder layers by an Int8Linear, in place (the model must
    already be in ACTIVATION_DTYPE). Returns how many were replaced."""
    if hf_model.dtype != ACTIVATION_DTYPE:
        raise ValueError(f"load the model in {ACTIVATION_DTYPE} before quantizing it to int8, not {hf_model.dtype}")
    count = 0
    for layer in hf_model.model.layers:
        for name, module in list(layer.named_modules()):
            if isinstance(module, torch.nn.Linear):
                parent_name, _, child = name.rpartition(".")
                parent = layer.get_submodule(parent_name) if parent_name else layer
                setattr(parent, child, Int8Linear.from_linear(module, ACTIVATION_DTYPE))
                count += 1
    return count


def weight_bytes(hf_model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the decoder layers' weights and of the LM head: what one full step must read."""
    layers = sum(p.numel() * p.element_size() for p in hf_model.model.layers.parameters())
    head = hf_model.lm_head.weight
    return {"layers": layers, "head": head.numel() * head.element_size()}
