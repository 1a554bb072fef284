"""minillm: a small, fast LLM inference engine, built chapter by chapter as a course.

    import minillm
    llm = minillm.LLM()                                  # the embedded SmolLM2-135M-Instruct
    llm.generate("The capital of France is", minillm.SamplingParams(max_tokens=8))[0].outputs[0].text
    tok = minillm.load_tokenizer()                       # its tokenizer alone (chapter 01)
"""

__version__ = "0.1.0"


def _kernels_from_source_tree() -> None:
    """kernels/ sits beside minillm/ in the repository and is installed as minillm.kernels. When
    minillm is imported straight from a checkout that shadows the installed copy (`python -m ...` in
    the repo root), load kernels/ from beside it under that same name."""
    import importlib.util
    import sys
    from pathlib import Path

    if "minillm.kernels" in sys.modules or importlib.util.find_spec("minillm.kernels") is not None:
        return
    init = Path(__file__).resolve().parent.parent / "kernels" / "__init__.py"
    if init.is_file():
        spec = importlib.util.spec_from_file_location("minillm.kernels", init,
                                                      submodule_search_locations=[str(init.parent)])
        module = importlib.util.module_from_spec(spec)
        sys.modules["minillm.kernels"] = module
        spec.loader.exec_module(module)


_kernels_from_source_tree()

from .config import ModelConfig  # noqa: E402
from .engine import EngineConfig, LLMEngine  # noqa: E402
from .llm import LLM  # noqa: E402
from .lora.request import LoRARequest  # noqa: E402
from .outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from .sampling import SamplingParams  # noqa: E402
from .tokenizer import Tokenizer, load_tokenizer  # noqa: E402

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "LoRARequest", "Logprob", "ModelConfig", "RequestOutput",
           "SamplingParams", "Tokenizer",
           "__version__", "load_tokenizer"]
