"""tokenmill: an LLM inference and serving engine."""

from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name: str):
    # LLM and LLMEngine pull in torch; import them on first use so `import tokenmill` stays light.
    if name == "LLM":
        from tokenmill.engine.llm import LLM
        return LLM
    if name == "LLMEngine":
        from tokenmill.engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
