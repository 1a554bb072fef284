"""minillm: a small, fast LLM inference engine, built chapter by chapter as a course.

The public API grows with the chapters; today it holds the tokenizer (chapter 01):

    import minillm
    tok = minillm.load_tokenizer()          # the embedded SmolLM2-135M-Instruct's tokenizer
"""

from .tokenizer import Tokenizer, load_tokenizer

__version__ = "0.1.0"
__all__ = ["Tokenizer", "__version__", "load_tokenizer"]
