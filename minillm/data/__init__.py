"""Text data: the Wikipedia corpus that calibration (AWQ, GPTQ) and perplexity use (chapter 08)."""

from .corpus import Article, Corpus, corpus_path, load_corpus

__all__ = ["Article", "Corpus", "corpus_path", "load_corpus"]
