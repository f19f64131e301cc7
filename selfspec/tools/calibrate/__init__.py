"""`selfspec calibrate`: train a small draft head for early exit by distillation from the model itself;
the model stays frozen. A recipe per head, on shared parts:

  data.py          the examples: the model's own greedy outputs, read off while they are generated
                   (hidden states at each exit, the teacher's top tokens), plain text teacher-forced,
                   and the held-out split by prompt
  loss.py          the distillation loss: KL on the teacher's top tokens plus "everything else"
  exit_adapter.py  the exit adapter's recipe, and the whole run (`calibrate`)
  result.py        what a run produced, and `save`: the heads, the draft-head ranking, the profile
  selfspec.tools.context_calibrate, .feature_calibrate: the context and feature heads' recipes

Also counted: how often each token occurs in the prompts and the model's outputs, ranked and saved
for the pruned draft head (selfspec.heads.draft_head, `--draft-vocab N`).
"""

from selfspec.tools.calibrate.exit_adapter import calibrate, default_exit_layers
from selfspec.tools.calibrate.result import Calibration, Trained, save

__all__ = ["Calibration", "Trained", "calibrate", "default_exit_layers", "save"]
