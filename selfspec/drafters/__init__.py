"""Drafters, one file per family, all behind the interface in `base`.

DRAFTERS maps a method name (as the CLI and the API take it) to a factory that receives every
option a method may use and picks its own, so adding a drafter never touches the engine or the CLI.
"""

from collections.abc import Callable

from selfspec.drafters.autoregressive import Autoregressive
from selfspec.drafters.base import Draft, DraftContext, Drafter
from selfspec.drafters.early_exit import EarlyExit

DRAFTERS: dict[str, Callable[..., Drafter]] = {
    "ar": lambda **options: Autoregressive(),
    "early-exit": lambda *, exit_layer, draft_len, **options: EarlyExit(exit_layer, draft_len),
}
METHODS = tuple(DRAFTERS)


def make_drafter(method: str, **options) -> Drafter:
    if method not in DRAFTERS:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    return DRAFTERS[method](**options)


__all__ = ["DRAFTERS", "METHODS", "Autoregressive", "Draft", "DraftContext", "Drafter", "EarlyExit", "make_drafter"]
