"""The offline API, shaped like vLLM's `LLM` so users' code ports."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

from tqdm import tqdm

from tokenmill.config import EngineConfig
from tokenmill.engine.beam_search import (BeamSearch, BeamSearchOutput, BeamSearchParams, beam_step_params,
                                          top_logprobs, with_texts)
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.lora.request import LoRARequest
from tokenmill.multimodal.chat_parts import messages_and_images
from tokenmill.multimodal.media import MediaPolicy
from tokenmill.outputs import (EmbeddingOutput, EmbeddingRequestOutput, RequestOutput, ScoringOutput,
                               ScoringRequestOutput)
from tokenmill.pooling.pooler_config import runs_pooling
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.pooling.model import EmbeddingModel

_EMBED_BATCH = 256  # inputs per encode call of LLM.embed
PromptType = Union[str, list[int], dict[str, Any]]
Messages = list[dict[str, Any]]


class LLM:
    """Generate text for batches of prompts in-process.

    `LLM(model=..., **engine_options)` takes every engine option as a keyword (dtype, max_model_len,
    block_size, num_kv_blocks, kv_cache_memory_gb, max_num_batched_tokens, max_num_seqs, seed, ...).
    """

    def __init__(self, model: Optional[str] = None, **engine_options: Any) -> None:
        config = EngineConfig.from_kwargs(model=model, **engine_options)
        self._ids = itertools.count()
        self.embedder: Optional[EmbeddingModel] = None  # an embedding model's (runner "pooling")
        self.llm_engine: Optional[LLMEngine] = None  # a generative model's
        if runs_pooling(config.model):
            from tokenmill.models.loader import model_location
            from tokenmill.pooling.model import load_embedding_model
            m = config.model
            self.embedder = load_embedding_model(m.model, m.dtype, m.device, m.max_model_len, m.attention_backend,
                                                 any_decoder=m.runner == "pooling", location=model_location(m))
        else:
            self.llm_engine = LLMEngine(config)

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """Wrap an engine that is already built (e.g. one sharing a loaded ModelSource)."""
        llm = cls.__new__(cls)
        llm.llm_engine, llm.embedder, llm._ids = engine, None, itertools.count()
        return llm

    def shutdown(self) -> None:
        """Stop the engine's worker processes, if it has any (they also stop when this process exits)."""
        if self.llm_engine is not None:
            self.llm_engine.shutdown()

    def get_tokenizer(self) -> Any:
        """The model's (Hugging Face) tokenizer."""
        return self.embedder.tokenizer if self.embedder is not None else self.llm_engine.tokenizer

    def embed(self, prompts: Union[PromptType, Sequence[PromptType]], dimensions: Optional[int] = None,
              truncate_prompt_tokens: Optional[int] = None) -> list[EmbeddingRequestOutput]:
        """One vector per prompt (pooled and normalised as the model's sentence-transformers files say),
        computed in batches of up to 256 inputs. `dimensions`: a matryoshka model's leading dimensions;
        `truncate_prompt_tokens`: cut inputs to their first k tokens (-1: the model's limit)."""
        embedder = self._embedding_model("embed")
        sequences = embedder.input_tokens([_pooling_input(p) for p in _as_batch(prompts)], truncate_prompt_tokens)
        for tokens in sequences:
            embedder.check_tokens(tokens)
        embedder.check_dimensions(dimensions)
        vectors = [v for start in range(0, len(sequences), _EMBED_BATCH)
                   for v in embedder.encode(sequences[start:start + _EMBED_BATCH], dimensions)]
        return [EmbeddingRequestOutput(str(next(self._ids)), tokens, EmbeddingOutput(v.tolist()))
                for tokens, v in zip(sequences, vectors)]

    def score(self, text_1: Union[str, Sequence[str]], text_2: Union[str, Sequence[str]],
              truncate_prompt_tokens: Optional[int] = None) -> list[ScoringRequestOutput]:
        """The cosine similarity of each (text_1, text_2) pair: one text_1 against every text_2, or the
        two lists pairwise (as vLLM scores with an embedding model)."""
        first = [text_1] if isinstance(text_1, str) else list(text_1)
        second = [text_2] if isinstance(text_2, str) else list(text_2)
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second) or not second:
            raise ValueError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as "
                             "many as text_2")
        a = self.embed(first, truncate_prompt_tokens=truncate_prompt_tokens)
        b = self.embed(second, truncate_prompt_tokens=truncate_prompt_tokens)
        return [ScoringRequestOutput(str(next(self._ids)), x.prompt_token_ids + y.prompt_token_ids,
                                     ScoringOutput(_cosine(x.outputs.embedding, y.outputs.embedding)))
                for x, y in zip(a, b)]

    def _generating_model(self, method: str) -> LLMEngine:
        if self.llm_engine is None:
            raise ValueError(f"this is an embedding model (runner 'pooling'): use LLM.embed or LLM.score, not "
                             f"LLM.{method}")
        return self.llm_engine

    def _embedding_model(self, method: str) -> EmbeddingModel:
        if self.embedder is None:
            raise ValueError(f"LLM.{method} needs an embedding model (runner 'pooling'); this model generates text")
        return self.embedder

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's LLM.reset_prefix_cache); False while requests hold blocks."""
        return self._generating_model("reset_prefix_cache").reset_prefix_cache()

    def update_weights_from_disk(self, model_path: str) -> int:
        """Generate from now on with the weights of the checkpoint at `model_path` (the same model, its shapes and
        format checked; copied in place), the prefix cache forgotten; the bytes copied. See
        LLMEngine.update_weights_from_disk."""
        return self._generating_model("update_weights_from_disk").update_weights_from_disk(model_path)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: Optional[str] = None,
                                  timeout_s: float = 120.0) -> None:
        """Join the process group a trainer (rank 0) streams new weights over; see
        LLMEngine.init_weights_update_group."""
        self._generating_model("init_weights_update_group").init_weights_update_group(
            master_address, master_port, rank_offset, world_size, group_name, backend, timeout_s)

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                        shapes: Sequence[Sequence[int]], group_name: Optional[str] = None) -> int:
        """Serve the tensors the trainer broadcasts (one per name, of the dtypes and shapes given) in place of the
        checkpoint's, the prefix cache forgotten; the bytes copied. See LLMEngine.update_weights_from_distributed."""
        return self._generating_model("update_weights_from_distributed").update_weights_from_distributed(
            names, dtypes, shapes, group_name)

    def destroy_weights_update_group(self, group_name: Optional[str] = None) -> bool:
        """Leave the trainer's weight-update group; False when not in one."""
        return self._generating_model("destroy_weights_update_group").destroy_weights_update_group(group_name)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: Optional[dict] = None) -> list:
        """vLLM's LLM.collective_rpc: a method of the worker extension class on every worker; their results."""
        return self._generating_model("collective_rpc").collective_rpc(method, args, kwargs)

    def sleep(self, level: int = 1) -> dict[str, int]:
        """vLLM's LLM.sleep: level 1 gives the KV pool's memory back, level 2 the weights' too (reloaded by
        `wake_up`); the resident memory before and after. See LLMEngine.sleep."""
        return self._generating_model("sleep").sleep(level)

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        """vLLM's LLM.wake_up: `tags` "weights", "kv_cache" (None: both)."""
        self._generating_model("wake_up").wake_up(tags)

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 use_tqdm: bool = True, priority: Optional[Sequence[int]] = None,
                 lora_request: Union[None, LoRARequest, Sequence[Optional[LoRARequest]]] = None) -> list[RequestOutput]:
        """Complete every prompt; returns one finished RequestOutput per prompt, in order.

        A prompt is a string, a list of token ids, or a dict with "prompt" or "prompt_token_ids" (and, for
        a vision-language model, "multi_modal_data": {"image": a PIL image or a list of them}, one per
        image placeholder of the prompt, in order: vLLM's shape), or {"prompt_embeds": a [tokens, hidden] tensor}
        under enable_prompt_embeds. A list of ints is one tokenised prompt; a list of strings or of lists is a
        batch.
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base model); the
        engine needs enable_lora, and loads an adapter on its first use.
        """
        self._generating_model("generate")
        batch = _as_batch(prompts)
        params = _params_per_prompt(sampling_params, len(batch))
        priorities = list(priority) if priority is not None else [0] * len(batch)
        if len(priorities) != len(batch):
            raise ValueError(f"priority has {len(priorities)} entries for {len(batch)} prompts")
        adapters = (list(lora_request) if isinstance(lora_request, (list, tuple))
                    else [lora_request] * len(batch))
        if len(adapters) != len(batch):
            raise ValueError(f"lora_request has {len(adapters)} entries for {len(batch)} prompts")
        ids = []
        try:
            for prompt, p, prio, adapter in zip(batch, params, priorities, adapters):
                request_id = str(next(self._ids))
                text, token_ids = _split_prompt(prompt)
                if token_ids is None and isinstance(prompt, dict) and not prompt.get("add_special_tokens", True):
                    token_ids = self.llm_engine.tokenize(text, add_special_tokens=False)
                self.llm_engine.add_request(request_id, text, p, prompt_token_ids=token_ids, priority=prio,
                                            lora_request=adapter, images=_prompt_images(prompt),
                                            prompt_embeds=prompt.get("prompt_embeds") if isinstance(prompt, dict)
                                            else None)
                ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def beam_search(self, prompts: Union[PromptType, Sequence[PromptType]], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search for every prompt (engine/beam_search.py: Hugging Face's algorithm and scores); each
        output's `sequences` are its finished hypotheses, best first, with their text."""
        engine = self._generating_model("beam_search")
        batch = _as_batch(prompts)
        searches = []
        for prompt in batch:
            text, token_ids = _split_prompt(prompt)
            ids = token_ids if token_ids is not None else engine.tokenize(text)
            searches.append(BeamSearch(ids, params, engine.eos_token_ids))
        step = beam_step_params(searches[0].num_candidates) if searches else None
        bar = tqdm(total=params.max_tokens, desc="beam search", unit="step", disable=not use_tqdm)
        with bar:
            while any(not search.done for search in searches):
                live = [search for search in searches if not search.done]
                beams = [beam for search in live for beam in search.beam_prompts()]
                outputs = iter(self.generate(beams, step, use_tqdm=False))
                for search in live:
                    search.advance([top_logprobs(next(outputs)) for _ in search.running])
                bar.update(1)
        return with_texts([search.output() for search in searches], engine.tokenizer)

    def chat(self, messages: Union[Messages, Sequence[Messages]],
             sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: Optional[str] = None) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate the assistant's reply. A
        vision-language model takes images in the messages' content lists (multimodal/chat_parts.py):
        `image_url` parts with data URLs, and `image_pil` parts."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            rendered, images = messages_and_images(conversation, MediaPolicy())
            prompt = {"prompt": self.apply_chat_template(rendered, add_generation_prompt, chat_template),
                      "add_special_tokens": False}
            if images:
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: Messages, add_generation_prompt: bool = True,
                            chat_template: Optional[str] = None) -> str:
        """The prompt text the model's chat template makes of `messages`."""
        tokenizer = self.get_tokenizer()
        template = chat_template or self._generating_model("chat").source.chat_template
        if not template:
            raise ValueError("this model has no chat template; pass chat_template=... or use generate()")
        return tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template,
                                             add_generation_prompt=add_generation_prompt)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm)
        try:
            while len(finished) < len(ids) and engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in finished])
            raise
        finally:
            bar.close()
        return [finished[i] for i in ids]


def _as_batch(prompts: Union[PromptType, Sequence[PromptType]]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return prompts


def _params_per_prompt(params: Union[None, SamplingParams, Sequence[SamplingParams]], count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return params


def _split_prompt(prompt: PromptType) -> tuple[Optional[str], Optional[list[int]]]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"], None
        if "prompt_embeds" in prompt:
            return None, None
        raise ValueError("a prompt dict needs 'prompt', 'prompt_token_ids' or 'prompt_embeds'")
    if isinstance(prompt, list):
        return None, prompt
    raise ValueError(f"unsupported prompt type {type(prompt).__name__}")


def _prompt_images(prompt: PromptType) -> list[Any]:
    """The images of a prompt dict's multi_modal_data (vLLM's shape); ValueError for other kinds of data."""
    if not isinstance(prompt, dict) or not prompt.get("multi_modal_data"):
        return []
    data = prompt["multi_modal_data"]
    if not isinstance(data, dict) or set(data) - {"image"}:
        kinds = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"multi_modal_data takes {{'image': image or [images]}}; got {kinds}")
    images = data.get("image")
    return list(images) if isinstance(images, (list, tuple)) else [images]  # PIL images or ImageInputs


def _cosine(a: list[float], b: list[float]) -> float:
    norm = (sum(x * x for x in a) * sum(y * y for y in b)) ** 0.5
    return sum(x * y for x, y in zip(a, b)) / norm if norm else 0.0


def _pooling_input(prompt: PromptType) -> Union[str, list[int]]:
    text, token_ids = _split_prompt(prompt)
    return token_ids if token_ids is not None else text
