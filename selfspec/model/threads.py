"""How many threads torch's ops use: the cores no other process is keeping busy.

Each CPU op ends at an OpenMP barrier that waits for its slowest thread. When another process holds
a core, the OS deschedules one of our threads for a whole time slice and every op stalls behind it:
on 2 cores with one busy neighbour, plain decoding ran 2.6× slower at 2 threads than at 1 here (28×
on a user's machine). So we sample how busy each usable core is for a moment before loading, and use
only the free ones. (OMP_WAIT_POLICY=PASSIVE also rescues 2 threads under contention, but costs ~5%
when idle, so it is left to the user; see README, "Shared CPUs: threads".)

Order of precedence: `--threads N`, then $SELFSPEC_THREADS, then $OMP_NUM_THREADS (torch already
obeys it; we leave it be), then the cores found free.
"""

from __future__ import annotations

import os
import time

import torch

WINDOW_S = 0.15  # long enough for 10 ms jiffies to resolve a >50% busy core, short beside a model load
BUSY_SHARE = 0.5  # a core counts busy when others keep it more than half busy


def _affinity() -> set[int]:
    """The CPUs this process may run on (its affinity mask, e.g. under taskset or a container cpuset)."""
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def _sample(window_s: float) -> tuple[str, str, float]:
    """/proc/stat before and after `window_s`, and this process's CPU use meanwhile in cores."""
    with open("/proc/stat") as f:
        before = f.read()
    start, own = time.monotonic(), time.process_time()
    time.sleep(window_s)
    own, elapsed = time.process_time() - own, time.monotonic() - start
    with open("/proc/stat") as f:
        return before, f.read(), own / max(elapsed, 1e-3)


def cpu_times(text: str) -> dict[int, tuple[int, int]]:
    """Per-CPU (busy, total) jiffies from the text of /proc/stat; idle and iowait count as not busy."""
    times = {}
    for line in text.splitlines():
        name, *fields = line.split() or [""]
        if not (name.startswith("cpu") and name[3:].isdigit()):
            continue  # the "cpu" total line, interrupts, context switches...
        ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal (guest is in user)
        total = sum(ticks)
        times[int(name[3:])] = (total - ticks[3] - ticks[4], total)
    return times


def busy_cores(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]], cpus: set[int],
               own_cores: float = 0.0) -> int:
    """Cores other processes kept busy between two /proc/stat samples, counted over `cpus`.

    The busy shares are summed across cores before rounding, because the OS migrates a busy process
    between cores within the window (one busy process can read as two half-busy cores). `own_cores`
    is this process's CPU use in the window, in cores, which is not someone else's load."""
    busy = -own_cores
    for cpu in cpus & before.keys() & after.keys():
        ticks = after[cpu][1] - before[cpu][1]
        if ticks > 0:
            busy += (after[cpu][0] - before[cpu][0]) / ticks
    return max(0, int(busy + 1 - BUSY_SHARE))  # a core over BUSY_SHARE busy counts as one


def running_others(loadavg: str) -> int:
    """Other runnable tasks from /proc/loadavg's 'running/total' field (this reader is one of them):
    the fallback when /proc/stat is unreadable; an instant, not an average, so rougher."""
    return max(0, int(loadavg.split()[3].split("/")[0]) - 1)


def free_cores(window_s: float = WINDOW_S) -> tuple[int, int]:
    """(free, usable): usable cores minus those another process keeps busy, at least 1."""
    cpus = _affinity()
    try:
        before, after, own_cores = _sample(window_s)
        busy = busy_cores(cpu_times(before), cpu_times(after), cpus, own_cores)
    except (OSError, ValueError, IndexError):
        try:
            with open("/proc/loadavg") as f:
                busy = running_others(f.read())
        except (OSError, ValueError, IndexError):
            busy = 0  # not Linux: no way to tell, keep every core
    return max(1, len(cpus) - busy), len(cpus)


def requested_threads(requested: int | None) -> int | None:
    """The explicit choice: `--threads`, else $SELFSPEC_THREADS; None for automatic."""
    if requested is None and os.environ.get("SELFSPEC_THREADS", "").strip():
        try:
            requested = int(os.environ["SELFSPEC_THREADS"])
        except ValueError:
            raise ValueError(f"$SELFSPEC_THREADS must be a whole number, got {os.environ['SELFSPEC_THREADS']!r}") from None
    if requested is not None and requested < 1:
        raise ValueError(f"--threads must be >= 1, got {requested}")
    return requested


def choose_threads(requested: int | None) -> tuple[int, str]:
    """(threads, why) for torch's intra-op pool; `why` is a short phrase for the user."""
    requested = requested_threads(requested)
    if requested is not None:
        return requested, "as asked"
    if os.environ.get("OMP_NUM_THREADS", "").strip():
        return torch.get_num_threads(), "from $OMP_NUM_THREADS"
    free, usable = free_cores()
    if free == usable:
        return usable, f"{usable} cores free"
    return free, f"{usable - free} of {usable} cores busy with other work"


def apply_threads(requested: int | None) -> str | None:
    """Set torch's thread count; returns a one-line description when that changes torch's current
    count (at start, its default: all cores), else None, so callers print only the unexpected."""
    default = torch.get_num_threads()
    threads, why = choose_threads(requested)
    torch.set_num_threads(threads)
    if threads == default:
        return None
    return f"{threads} thread{'s' if threads != 1 else ''} ({why})"
