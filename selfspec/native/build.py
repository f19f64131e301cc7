"""Where the native kernels are built and cached, and other files selfspec writes for a model."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where converted checkpoints live: $SELFSPEC_CACHE, else $XDG_CACHE_HOME/selfspec, else ~/.cache/selfspec."""
    if os.environ.get("SELFSPEC_CACHE"):
        return Path(os.environ["SELFSPEC_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "selfspec"
    return Path.home() / ".cache" / "selfspec"
