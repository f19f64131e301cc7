"""Drafters, one file per family, all behind the interface in `base`."""

from selfspec.drafters.autoregressive import Autoregressive
from selfspec.drafters.base import Draft, DraftContext, Drafter
from selfspec.drafters.early_exit import EarlyExit

METHODS = ("ar", "early-exit")


def make_drafter(method: str, *, exit_layer: int | None, draft_len: int) -> Drafter:
    if method == "ar":
        return Autoregressive()
    if method == "early-exit":
        if exit_layer is None:
            raise ValueError("early-exit needs an exit layer k")
        return EarlyExit(exit_layer, draft_len)
    raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")


__all__ = ["Autoregressive", "Draft", "DraftContext", "Drafter", "EarlyExit", "METHODS", "make_drafter"]
