"""tokenmill: an LLM inference and serving engine."""

# PyTorch's CPU allocator puts tensors of 2 MB and more on transparent huge pages when this is set; it
# reads it once, at its first allocation, so it is set before anything imports torch. A 2048-token
# prefill writes activations spread over thousands of 4 KB pages, and the TLB misses of those writes
# cost up to a third of an AMX projection (docs/benchmarks.md, "Huge pages"). THP_MEM_ALLOC_ENABLE=0
# in the environment keeps 4 KB pages.
from tokenmill import envs as _envs

_envs.prefer_huge_pages()

# A TOKENMILL_CPU_CAPABILITY cap also caps oneDNN and MKL (read at their first use, so set before torch
# runs any of them), so that a capped machine runs PyTorch's products as a machine of that level would.
_envs.cap_libraries_to_capability()

from tokenmill.engine.beam_search import BeamSearchParams
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.spec import StructuredOutput
from tokenmill.version import __version__

__all__ = ["LLM", "LLMEngine", "BeamSearchParams", "LoRARequest", "SamplingParams", "StructuredOutput", "RequestOutput", "CompletionOutput",
           "__version__"]


def __getattr__(name: str):
    # LLM and LLMEngine pull in torch; import them on first use so `import tokenmill` stays light.
    if name == "LLM":
        from tokenmill.engine.llm import LLM
        return LLM
    if name == "LLMEngine":
        from tokenmill.engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
