"""`selfspec train`: the LayerSkip recipe (Elhoushi et al. 2024), fine-tuning the model itself so
that its early exits draft better.

Calibration (selfspec.tools.calibrate) leaves the model frozen and fits a small exit adapter; this
changes every weight, for users who can fine-tune. Two things are added to plain next-token training:

  layer dropout   in training, layer l (0-based, of L) is skipped whole for a row of the batch with
                  probability p_l = p_max·(e^(l·ln2/(L-1)) - 1): 0 at the first layer, p_max at the
                  last. Later layers learn to be optional, so the residual stream at a shallow
                  depth already carries what the deep layers would add.
  early-exit loss the model's own final norm and LM head read the hidden state after layer k
                  (exit k, the state an early-exit draft at k uses) and the cross-entropy there is
                  added, scaled by e(k) (rising with depth, see `exit_scales`) and normalised over the
                  exits active at that step. A curriculum picks the active exits (`active_exits`):
                  rotational (every R-th exit, the set rotating each step), gradual (exits switched
                  on from the last layer downward over the first half of training) or none (all).

The result is a regular Hugging Face checkpoint; decoding with it stays lossless relative to it,
but it is a different model from the one trained: the report gives the full model's held-out loss
before and after as well as the exits' loss and α.

Terms: k (exit layer: the draft runs layers 0..k-1; k = L is the full model), α (here: the share
of positions of the model's own greedy output where the exit-k argmax equals the full model's, the
first draft token's acceptance rate; measured as tuner/trace.py does), CE (cross-entropy, nats per
token).

  recipe.py      the recipe's settings and schedules: dropout rates, exit weights, the curriculum
  exits.py       the hooks that run layer dropout and read the exits inside the model's own forward
  data.py        the training and held-out documents, from text files or the model's own answers
  evaluation.py  held-out losses, agreement and α before, during and after training
  run.py         the training loop, and `save`: a Hugging Face checkpoint with the report beside it
"""

from selfspec.tools.train.data import prepare
from selfspec.tools.train.recipe import Recipe
from selfspec.tools.train.run import default_exit_layers, save, train

__all__ = ["Recipe", "default_exit_layers", "prepare", "save", "train"]
