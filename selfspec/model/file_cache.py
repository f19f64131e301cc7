"""Files read once while unchanged: a server prepares every request with its model's profile and
builds every request's drafter from the same head files, so each is parsed on its first use and
parsed again only when its modification time or size changes (rewritten by a tune or a calibrate)."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


class FileCache:
    """Values read from files, each re-read when the file's (mtime, size) changes; the `maxsize`
    most recently used values are kept. Thread-safe: threads asking for a file being read wait for
    that one read. Values are shared, so callers must not change them (or change a copy)."""

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self._values: collections.OrderedDict = collections.OrderedDict()  # key -> ((mtime_ns, size), value)
        self._reading: dict = {}  # key -> the lock its one read holds
        self._lock = threading.Lock()

    def get(self, path: str | Path, read: Callable[..., T], *args) -> T:
        """`read(path, *args)`, read once while the file is unchanged (args are part of the key). A
        path that is not a file is not cached: `read` runs, to say what is missing."""
        resolved = Path(path).resolve()
        if not resolved.is_file():
            return read(path, *args)
        stat = resolved.stat()
        stamp, key = (stat.st_mtime_ns, stat.st_size), (str(resolved), read, *args)
        with self._lock:
            if (hit := self._fresh(key, stamp)) is not None:
                return hit[1]
            reading = self._reading.setdefault(key, threading.Lock())
        with reading:
            with self._lock:  # another thread may have read it while this one waited
                if (hit := self._fresh(key, stamp)) is not None:
                    return hit[1]
            try:
                value = read(path, *args)
                with self._lock:
                    self._values[key] = (stamp, value)
                    self._values.move_to_end(key)
                    while len(self._values) > self.maxsize:
                        self._values.popitem(last=False)
            finally:
                with self._lock:
                    self._reading.pop(key, None)
            return value

    def _fresh(self, key, stamp) -> tuple | None:
        """(stamp, value) for `key` when read at this stamp, marked most recently used; else None."""
        entry = self._values.get(key)
        if entry is None or entry[0] != stamp:
            return None
        self._values.move_to_end(key)
        return entry

    def clear(self) -> None:
        """Forget every value, as in a new process."""
        with self._lock:
            self._values.clear()

    def __len__(self) -> int:
        return len(self._values)
