"""The memory floor of a decode step: the bytes one full step must read, over the bandwidth this
machine measures. A one-token step of a small model can be no faster than streaming its weights
once; how far above that a step sits is overhead the engine could still remove.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from selfspec.model.quantize import weight_bytes


@dataclass
class Roofline:
    layer_bytes: int  # decoder layers' weights (what early exit at k reads k/L of)
    head_bytes: int  # the LM head's
    bandwidth: float  # bytes/s, streamed reads measured here
    step_s: float | None = None  # a measured one-token step, to compare

    @property
    def floor_s(self) -> float:
        return (self.layer_bytes + self.head_bytes) / self.bandwidth

    def to_json(self) -> dict:
        out = {"layer_bytes": self.layer_bytes, "head_bytes": self.head_bytes,
               "bandwidth_GBps": round(self.bandwidth / 1e9, 2), "floor_ms": round(self.floor_s * 1e3, 3)}
        if self.step_s is not None:
            out.update(step_ms=round(self.step_s * 1e3, 3), step_over_floor=round(self.step_s / self.floor_s, 3))
        return out

    def summary(self) -> str:
        text = (f"weights {(self.layer_bytes + self.head_bytes) / 1e6:.0f} MB (head {self.head_bytes / 1e6:.0f} MB), "
                f"bandwidth {self.bandwidth / 1e9:.1f} GB/s, memory floor {self.floor_s * 1e3:.1f} ms")
        if self.step_s is not None:
            text += f", step {self.step_s * 1e3:.1f} ms = {self.step_s / self.floor_s:.2f}× floor"
        return text


def measure_bandwidth(megabytes: int = 512, repeats: int = 10, device: str | torch.device = "cpu") -> float:
    """Bytes per second of a streamed read (a sum over a buffer far larger than the caches), with
    torch's current thread count (on a GPU: its memory); the best of `repeats`, as a step's
    weights stream best-case."""
    buffer = torch.ones(megabytes * 2**20 // 4, device=device)
    sync = torch.cuda.synchronize if buffer.device.type == "cuda" else (lambda: None)
    buffer.sum()
    best = float("inf")
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        buffer.sum()
        sync()
        best = min(best, time.perf_counter() - t)
    return buffer.numel() * 4 / best


def roofline(hf_model, step_s: float | None = None, bandwidth: float | None = None) -> Roofline:
    sizes = weight_bytes(hf_model)
    device = next(hf_model.parameters()).device
    return Roofline(sizes["layers"], sizes["head"], bandwidth or measure_bandwidth(device=device), step_s)
