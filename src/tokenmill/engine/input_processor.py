"""A request from what a user sent: every check against the model and the engine, run once, at the boundary."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence, Union

from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.kv_transfer import KVTransfers
from tokenmill.engine.lora_registry import LoRARegistry
from tokenmill.lora.request import LoRARequest
from tokenmill.multimodal.inputs import ImageFeature
from tokenmill.multimodal.processing import ImageLike, ImageProcessing
from tokenmill.request import Request, TenantShare
from tokenmill.sampling_params import SamplingParams


@dataclass(frozen=True)
class ProcessedRequest:
    """A request that passed every check: what the scheduler queues, and the prompt's text (None when
    it came as token ids) for the output processor."""

    request: Request
    prompt_text: Optional[str]


class InputProcessor:
    """Turns a user's prompt and parameters into a `Request`: tokenises, expands image placeholders,
    resolves the LoRA adapter, checks the request against the model and the scheduler's limits, compiles
    its grammar and takes its KV transfer. Raises ValueError naming the problem; nothing is queued then.

    Invariant: this is the only place a request is checked against the engine (the scheduler's
    `add_request` trusts it): `Scheduler.check_admissible` runs once per request."""

    def __init__(self, scheduler: Scheduler, architecture: str, vocab_size: int, max_model_len: int,
                 eos_token_ids: tuple[int, ...], tokenize: Callable[..., list[int]], compile_grammar: Callable,
                 schedule_policy: str, max_num_seqs: int, image_processing: Optional[ImageProcessing] = None,
                 loras: Optional[LoRARegistry] = None, kv_transfers: Optional[KVTransfers] = None,
                 prompt_embeds_width: Optional[int] = None) -> None:
        self.scheduler, self.architecture = scheduler, architecture
        self.vocab_size, self.max_model_len, self.eos_token_ids = vocab_size, max_model_len, eos_token_ids
        self.tokenize, self.compile_grammar = tokenize, compile_grammar
        self.schedule_policy, self.max_num_seqs = schedule_policy, max_num_seqs
        self.image_processing, self.loras, self.kv_transfers = image_processing, loras, kv_transfers
        self.prompt_embeds_width = prompt_embeds_width  # the model's hidden size with enable_prompt_embeds, else None

    def _bad_word_ids(self, params: SamplingParams) -> list[list[int]]:
        """Each bad word's token ids, as vLLM tokenises them: the word, and with a leading space where that makes
        another first token of as many tokens (the word in the middle of a text). ValueError where they leave no
        token that allowed_token_ids allows."""
        words: list[list[int]] = []
        for word in params.bad_words or ():
            plain = self.tokenize(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenize(" " + word.lstrip(), add_special_tokens=False)
            words.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                words.append(spaced)
        if params.allowed_token_ids is not None and set(params.allowed_token_ids) <= {w[0] for w in words if len(w) == 1}:
            raise ValueError("bad_words forbid every token allowed_token_ids allows: nothing could be generated")
        return words

    def process(self, request_id: str, prompt: Union[str, list[int], None], params: SamplingParams,
                prompt_token_ids: Optional[list[int]] = None, priority: int = 0,
                arrival_time: Optional[float] = None, lora_request: Optional[LoRARequest] = None,
                images: Sequence[ImageLike] = (), prompt_embeds: Any = None,
                background: bool = False, tenant: Optional[TenantShare] = None) -> ProcessedRequest:
        """The checked request (see the class); ValueError when it can never run. `prompt_embeds`: the prompt
        given as input embeddings instead (engine/prompt_embeds.py). `background`: a batch job's; `tenant`: who it is
        served for (both Request's)."""
        if lora_request is not None:
            if self.loras is None:
                raise ValueError("lora_request: this engine serves no LoRA adapters (start it with enable_lora)")
            params = replace(params, lora_request=self.loras.resolve(lora_request))
        if prompt_embeds is not None:
            text, (prompt_token_ids, embeds) = None, self._embeds_prompt(prompt, prompt_token_ids, images, params,
                                                                        prompt_embeds)
            image_features: tuple[ImageFeature, ...] = (embeds,)
        else:
            text, prompt_token_ids = self._prompt(prompt, prompt_token_ids)
            prompt_token_ids, image_features = self.with_images(self._check_prompt_ids(prompt_token_ids), images)
        if priority != 0 and self.schedule_policy != "priority":
            raise ValueError(f"priority {priority} is honoured only with schedule_policy 'priority' "
                             f"(this engine runs {self.schedule_policy!r})")
        params.check_vocabulary(self.vocab_size)
        if params.bad_words:
            params = replace(params, bad_words_token_ids=self._bad_word_ids(params))
        if params.n > self.max_num_seqs:
            raise ValueError(f"n ({params.n}) must be <= max_num_seqs ({self.max_num_seqs}): the samples of one "
                             f"request run in one batch")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt_token_ids)
            if max_tokens < 1:
                raise ValueError(f"The prompt has {len(prompt_token_ids)} tokens, which leaves no room to "
                                 f"generate within the model's maximum context length of "
                                 f"{self.max_model_len} tokens.")
        self.scheduler.check_admissible(len(prompt_token_ids), len(prompt_token_ids) + max_tokens)
        if params.structured_output is not None:
            self.compile_grammar(params.structured_output)  # raises ValueError naming what is invalid
        transfer = self._check_transfer(params)
        request = Request(request_id, prompt_token_ids, params, max_tokens, self.eos_token_ids,
                          priority, arrival_time, num_samples_to_fork=params.n - 1, images=image_features,
                          background=background, tenant=tenant)
        if transfer.get("do_remote_decode"):
            self.kv_transfers.plan_export(request)
        elif transfer.get("do_remote_prefill"):
            if self.kv_transfers.needs_fetch(transfer):  # served requests come fetched (AsyncEngine.generate)
                transfer = self.kv_transfers.fetch(transfer, len(prompt_token_ids))
            if transfer.get("do_remote_prefill"):
                self.kv_transfers.adopt(request, transfer)
        return ProcessedRequest(request, text)

    def _embeds_prompt(self, prompt: Union[str, list[int], None], prompt_token_ids: Optional[list[int]],
                       images: Sequence[ImageLike], params: SamplingParams, embeds: Any
                       ) -> tuple[list[int], ImageFeature]:
        """(placeholder token ids, the embeddings' feature) of a prompt given as embeddings; ValueError when the
        engine does not take them, the request mixes them with a prompt or images, or they are malformed."""
        if self.prompt_embeds_width is None:
            raise ValueError("prompt_embeds: this engine takes prompts as text or token ids (start it with "
                             "enable_prompt_embeds, the server with --enable-prompt-embeds)")
        if prompt is not None or prompt_token_ids or images:
            raise ValueError("prompt_embeds: give the prompt as embeddings alone, without a prompt, token ids or "
                             "images")
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: a prompt given as embeddings has no tokens to score")
        from tokenmill.engine.prompt_embeds import embeds_prompt

        return embeds_prompt(embeds, self.prompt_embeds_width, self.max_model_len)

    def _prompt(self, prompt: Union[str, list[int], None], prompt_token_ids: Optional[list[int]]
                ) -> tuple[Optional[str], list[int]]:
        """(the prompt's text when it came as text, its token ids)."""
        if prompt_token_ids is not None:
            return (prompt if isinstance(prompt, str) else None), prompt_token_ids
        if isinstance(prompt, str):
            return prompt, self.tokenize(prompt)
        if isinstance(prompt, list):
            return None, prompt
        raise ValueError("a request needs a prompt string or prompt token ids")

    def _check_prompt_ids(self, ids: list[int]) -> list[int]:
        if not ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}); got {bad[:5]}")
        return list(ids)

    def _check_transfer(self, params: SamplingParams) -> dict:
        """The request's kv_transfer_params ({} when none), checked."""
        if params.kv_transfer_params is None:
            return {}
        if self.kv_transfers is None:
            raise ValueError("kv_transfer_params: this server has no --kv-transfer-config")
        self.kv_transfers.check_params(params.kv_transfer_params)
        if params.n > 1:
            raise ValueError("kv_transfer_params: a transferred request has one sample (n must be 1)")
        return params.kv_transfer_params

    def with_images(self, prompt_token_ids: list[int], images: Sequence[ImageLike]
                    ) -> tuple[list[int], tuple[ImageFeature, ...]]:
        """The prompt with its images' placeholders expanded, and the images' features (`images` are images, or
        features that `prepare_images` made with this prompt); ValueError for images given to a text-only
        model, or placeholders and images that do not pair up."""
        processing = self.image_processing
        if not images:
            if processing is not None and processing.image_token_id in prompt_token_ids:
                raise ValueError(f"the prompt has image placeholders (token {processing.image_token_id}) "
                                 "but no image came with it")
            return prompt_token_ids, ()
        if processing is not None and all(isinstance(image, ImageFeature) for image in images):
            return prompt_token_ids, processing.check_prepared(prompt_token_ids, images)
        return self.prepare_images(prompt_token_ids, images)

    def prepare_images(self, prompt_token_ids: list[int], images: Sequence[ImageLike]
                       ) -> tuple[list[int], tuple[ImageFeature, ...]]:
        """The prompt with each image's placeholder expanded, and the images' features (multimodal/processing.py);
        thread-safe (the processing is set once and its processor keeps no state). ValueError for a text-only
        model, or placeholders and images that do not pair up."""
        if self.image_processing is None:
            raise ValueError(f"this model ({self.architecture}) is text-only: it takes no images")
        return self.image_processing.prepare(prompt_token_ids, images)
