"""selfspec: lossless self-speculative decoding. The model drafts with its own first k layers and
verifies with one full forward, on one shared KV cache; output is exactly the full model's."""

from selfspec.api import Chunk, Generation, SelfSpecModel, Stream, load
from selfspec.core.sampling import SamplingParams
from selfspec.core.stats import GenerationStats

__version__ = "0.1.0"

__all__ = ["Chunk", "Generation", "GenerationStats", "SamplingParams", "SelfSpecModel", "Stream", "load"]
