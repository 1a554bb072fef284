"""Measuring a model's quality: perplexity on held-out text (chapter 08)."""

from .perplexity import PerplexityResult, perplexity, windows

__all__ = ["PerplexityResult", "perplexity", "windows"]
