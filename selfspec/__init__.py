"""selfspec: lossless self-speculative decoding. The model drafts a few tokens cheaply from itself
(no second model) and verifies them with one full forward on one shared KV cache; output is exactly
the full model's. By default (method="auto") a model runs what `selfspec tune` measured fastest on
this machine, else the choice shipped for it (selfspec/data/shipped_profiles.json), else plain
decoding: for the bundled SmolLM2 on a CPU with AVX-512 or AMX that is hybrid, prompt lookup when
the context offers a match, else one token from its trained feature head. The drafter families,
early exit at layer k among them, are in selfspec.drafters."""

from selfspec.api import Chunk, Generation, SelfSpecModel, Stream, load
from selfspec.core.sampling import SamplingParams
from selfspec.core.speculation import Speculation
from selfspec.core.stats import GenerationStats

__version__ = "0.1.0"

__all__ = ["Chunk", "Generation", "GenerationStats", "SamplingParams", "SelfSpecModel", "Speculation", "Stream", "load"]
