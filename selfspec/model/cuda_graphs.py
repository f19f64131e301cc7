"""Exact mode's decode forwards replayed as CUDA graphs.

Why: on a GPU a small model's step is bound by kernel launches, not by the GPU: SmolLM2's 30
layers are several hundred small kernels, each a few microseconds of Python and driver time. In
exact mode every decode forward (AR step, draft, verify) has the same shapes (EXACT_ROWS rows,
attention over the whole cache), so a forward over a given layer plan can be captured once and
replayed with one call, its launches queued by the driver alone.

What varies between calls lives in two static input buffers filled before each replay: the
forward's rows (padded to the bucket) and their cache slots. Everything else a forward reads
(weights, the cache, the rotary tables, the exit states) sits at a fixed address, so a graph is
keyed by the layer plan and those addresses; the adapter reuses a generation's cache storage for
the next one of the same capacity so that later generations replay instead of capturing again.

Greedy identity is unchanged: a graph replays the very kernels, with the very shapes, that the
eager forward launches, and in exact mode every decode forward goes through a graph.

Capture is injectable (`graph_factory`) so that the keying and the static-buffer plumbing are
tested on the CPU with a stand-in that replays by calling the function again.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

# Graphs kept per model (least recently used dropped first): a plan is a layer range and skip set,
# and adaptive drafters (SWIFT, CLaSp) may try many.
LIMIT = 64


def enabled(device: torch.device) -> bool:
    """CUDA graphs for exact mode's forwards: on CUDA unless SELFSPEC_CUDA_GRAPHS=0."""
    return device.type == "cuda" and os.environ.get("SELFSPEC_CUDA_GRAPHS", "1") != "0"


class CaptureFailed(RuntimeError):
    """A forward could not be captured (an op that syncs with the host, say): run it eagerly."""


class CudaGraph:
    """One captured forward: warm up on a side stream (first calls allocate, tune and compile),
    then capture into a torch.cuda.CUDAGraph with its own memory pool."""

    def __init__(self, body: Callable[[], torch.Tensor]):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                body()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # Captured on the stream it warmed up on, whose per-stream library state (cuBLAS
        # workspaces) is set up by then, and in thread-local mode, so that another thread's CUDA
        # call (compile workers, Saguaro's drafting thread) cannot invalidate it. On an H200 the
        # tiny Qwen2 test model's capture failed without both (cause not established); neither
        # change is measured there yet, and LeanStep.run falls back to eager forwards when a
        # capture fails.
        with torch.cuda.graph(self.graph, stream=stream, capture_error_mode="thread_local"):
            self.out = body()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


class StepGraphs:
    """The captured forwards of one LeanStep, keyed by plan and by the addresses they read."""

    def __init__(self, step, graph_factory: Callable = CudaGraph, limit: int = LIMIT):
        self.step = step
        self.factory = graph_factory
        self.limit = limit
        self.graphs: OrderedDict[tuple, tuple] = OrderedDict()
        self.captures = 0  # graphs captured so far (tests and `bench` read it)
        self.replays = 0
        self._running = threading.local()  # .cache: the cache of the forward this thread runs (Saguaro drafts in a second)

    def run(self, h: torch.Tensor, layers: list[int], start: int, cache, skip, rows: int,
            body: Callable[[torch.Tensor, torch.Tensor, object], torch.Tensor]) -> torch.Tensor:
        """h [1, n, hidden] at positions start.. through `layers`, as body(x [rows, hidden], pos
        [rows], cache) computes it, replayed from a graph; returns [1, n, hidden]."""
        n = h.shape[1]
        key = self._key(layers, cache, skip, rows)
        entry = self.graphs.get(key)
        # The body reads the cache of the call at hand, not the one it was captured with (which
        # would keep that cache from returning its storage to the pool): the same addresses, by the key.
        self._running.cache = cache
        try:
            if entry is None:
                x = torch.empty(rows, h.shape[-1], dtype=h.dtype, device=h.device)
                pos = torch.empty(rows, dtype=torch.long, device=h.device)
                self._fill(x, pos, h, start, cache)
                try:
                    graph = self.factory(lambda: body(x, pos, self._running.cache))
                except RuntimeError as err:  # torch.AcceleratorError too
                    raise CaptureFailed(f"{type(err).__name__}: {str(err).splitlines()[0]}") from err
                entry = self.graphs[key] = (graph, x, pos)
                self.captures += 1
                while len(self.graphs) > self.limit:
                    self.graphs.popitem(last=False)
            else:
                self.graphs.move_to_end(key)
                self._fill(entry[1], entry[2], h, start, cache)
            out = entry[0].replay()
        finally:
            self._running.cache = None
        self.replays += 1
        # A copy: the graph's output buffer is overwritten by its next replay.
        return out[:n].clone().unsqueeze(0)

    @staticmethod
    def _fill(x: torch.Tensor, pos: torch.Tensor, h: torch.Tensor, start: int, cache) -> None:
        """The static inputs: h's rows, then copies of its last row (padding that rounds like a
        real row); slots start.., the padding rows' the cache's scratch slot (see LeanStep.run)."""
        n = h.shape[1]
        x[:n].copy_(h[0])
        x[n:].copy_(h[0, n - 1 :].expand(x.shape[0] - n, -1))
        torch.arange(start, start + x.shape[0], out=pos)
        pos[n:].fill_(cache.capacity - 1)

    def _key(self, layers, cache, skip, rows: int) -> tuple:
        layers = tuple(layers)
        ropes = tuple(t.data_ptr() for pair in self.step.adapter.rope_tables().values() for t in pair)
        exit_states = cache.exit_states.data_ptr() if cache.exit_states is not None else None
        return (layers, tuple(i for i in layers if i in skip.attn), tuple(i for i in layers if i in skip.mlp),
                rows, cache.capacity, cache.keys.data_ptr(), cache.values.data_ptr(), cache.exit_layer,
                exit_states, ropes)
