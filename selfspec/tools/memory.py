"""Peak memory of a block of work, for the benchmark's memory columns.

    with peak_memory(device) as mem:
        model.generate(...)
    mem.peak, mem.extra  # bytes

On CUDA the figures are the caching allocator's: `peak` is torch.cuda.max_memory_allocated over
the block, `before` is what was allocated when it began (weights included). On CPU they are the
process's resident set (RSS): a background thread reads /proc/self/statm every `interval_s`
and keeps the largest value, so `peak` includes the weights, the Python runtime and everything
else resident, and a spike shorter than the interval can be missed. The default, 5 ms, left
SmolLM2's tokens/s on a 2-core CPU within noise; polling every 1 ms cost about 10% (the thread
takes the GIL from the decode loop each time it wakes).

glibc keeps freed memory for reuse instead of returning it to the system, so a block could reuse
pages an earlier block freed and show no growth at all. The CPU path therefore calls glibc's
malloc_trim(0) before reading `before`, handing free pages back so that what the block allocates
shows up as new resident memory. Where /proc is missing (macOS) the only figure is getrusage's
ru_maxrss, the lifetime high-water mark: `extra` is then how far the block raised it, a lower bound.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

MIB = 1024 * 1024
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass
class MemoryUse:
    before: int = 0  # bytes in use just before the block
    peak: int = 0  # most bytes in use during it (>= before)

    @property
    def extra(self) -> int:
        """What the block needed beyond what was already in use."""
        return max(0, self.peak - self.before)


@contextmanager
def peak_memory(device: torch.device | str = "cpu", interval_s: float = 0.005) -> Iterator[MemoryUse]:
    """Measure the block's peak memory; the yielded MemoryUse is filled in when the block ends."""
    device = torch.device(device)
    if device.type == "cuda":
        with _cuda_peak(device) as use:
            yield use
    else:
        with _rss_peak(interval_s) as use:
            yield use


@contextmanager
def _cuda_peak(device: torch.device) -> Iterator[MemoryUse]:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    use = MemoryUse(before=torch.cuda.memory_allocated(device))
    try:
        yield use
    finally:
        torch.cuda.synchronize(device)
        use.peak = max(use.before, torch.cuda.max_memory_allocated(device))


@contextmanager
def _rss_peak(interval_s: float) -> Iterator[MemoryUse]:
    _release_freed_memory()
    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY)
    except OSError:
        fd = None
    if fd is None:  # no /proc: the lifetime high-water mark is all there is
        use = MemoryUse(before=_max_rss())
        try:
            yield use
        finally:
            use.peak = max(use.before, _max_rss())
        return

    def rss() -> int:  # statm: size resident shared ... (in pages); pread needs no seek and no new file
        return int(os.pread(fd, 128, 0).split()[1]) * _PAGE

    use = MemoryUse(before=rss())
    use.peak = use.before
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(interval_s):
            use.peak = max(use.peak, rss())

    thread = threading.Thread(target=poll, name="peak-rss", daemon=True)
    thread.start()
    try:
        yield use
    finally:
        stop.set()
        thread.join()
        use.peak = max(use.peak, rss())
        os.close(fd)


def _release_freed_memory() -> None:
    """Return free heap pages to the system (glibc's malloc_trim); a no-op elsewhere."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _max_rss() -> int:
    """getrusage's peak resident set: KiB on Linux, bytes on macOS."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
