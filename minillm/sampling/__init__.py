"""Chapter 02: choosing the next token. SamplingParams (vLLM-shaped) and a batched Sampler."""

from .rng import uniforms
from .sampler import Sampler, SamplerOutput, SamplingMetadata, apply_penalties, filtered_probs
from .sampling_params import SamplingParams

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata", "SamplingParams", "apply_penalties",
           "filtered_probs", "uniforms"]
