"""minillm: a small, fast LLM inference engine, built chapter by chapter as a course.

    import minillm
    llm = minillm.LLM()                                  # the embedded SmolLM2-135M-Instruct
    llm.generate("The capital of France is", minillm.SamplingParams(max_tokens=8))[0].outputs[0].text
    tok = minillm.load_tokenizer()                       # its tokenizer alone (chapter 01)
"""

__version__ = "0.1.0"

from .config import ModelConfig
from .llm import LLM
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling import SamplingParams
from .tokenizer import Tokenizer, load_tokenizer

__all__ = ["LLM", "CompletionOutput", "Logprob", "ModelConfig", "RequestOutput", "SamplingParams", "Tokenizer",
           "__version__", "load_tokenizer"]
