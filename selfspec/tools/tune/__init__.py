"""The tuner: which self-speculative configuration speeds this model up on this machine, and by
how much. `run` orchestrates; `trace` reads exact acceptance off AR decodes; `costs` times c and
v; `rounds` turns both into predicted speedups; `plots` draws them."""

from selfspec.tools.tune.run import SECTION, Candidate, TuneResult, default_exit_grid, tune

__all__ = ["SECTION", "Candidate", "TuneResult", "default_exit_grid", "tune"]
