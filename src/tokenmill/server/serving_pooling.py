"""The embedding routes' handlers: /v1/embeddings (OpenAI's shape), /v1/score and /v1/rerank (vLLM's).

Score and rerank with an embedding model are the cosine similarity of the two texts' vectors, as vLLM
computes them for embedding models.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any, Optional, Union

import torch

from tokenmill.pooling.engine import PoolingEngine
from tokenmill.server.pooling_protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from tokenmill.server.request_limits import RequestLimits
from tokenmill.server.serving_common import APIError, new_id, now


class PoolingHandler:
    """Answers the embedding routes over a running PoolingEngine."""

    def __init__(self, engine: PoolingEngine, model_name: str, limits: RequestLimits) -> None:
        self.engine, self.model_name, self.limits = engine, model_name, limits
        self.model = engine.model

    async def embeddings(self, body: EmbeddingRequest) -> dict[str, Any]:
        """OpenAI's embeddings response: one vector per input, as floats or base64 of little-endian float32."""
        inputs = body.inputs()
        if not inputs:
            raise APIError(400, "'input' must not be empty", param="input")
        self.limits.check_prompts(len(inputs))
        sequences = await self._tokenize(inputs, body.truncate_prompt_tokens, body.add_special_tokens, "input")
        vectors = await self._vectors(sequences, body.dimensions, "dimensions")
        data = [{"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
                for i, v in enumerate(vectors)]
        tokens = sum(len(s) for s in sequences)
        return {"object": "list", "id": new_id("embd"), "created": now(), "model": self.model_name, "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def score(self, body: ScoreRequest) -> dict[str, Any]:
        """vLLM's score response: the similarity of each (text_1, text_2) pair."""
        try:
            pairs = body.pairs()
        except ValueError as exc:
            raise APIError(400, str(exc), param="text_2") from None
        self.limits.check_prompts(len(pairs) + 1)
        firsts = list(dict.fromkeys(a for a, _ in pairs))
        scores, tokens = await self._similarities(firsts, [b for _, b in pairs], body.truncate_prompt_tokens)
        data = [{"index": i, "object": "score", "score": scores[firsts.index(a)][i]} for i, (a, _) in enumerate(pairs)]
        return {"id": new_id("score"), "object": "list", "created": now(), "model": self.model_name, "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def rerank(self, body: RerankRequest) -> dict[str, Any]:
        """The Cohere/Jina rerank response vLLM serves: documents by relevance, most relevant first."""
        self.limits.check_prompts(len(body.documents) + 1)
        scores, tokens = await self._similarities([body.query], body.documents, body.truncate_prompt_tokens)
        order = sorted(range(len(body.documents)), key=lambda i: -scores[0][i])
        if body.top_n:
            order = order[:body.top_n]
        results = [{"index": i, "relevance_score": scores[0][i],
                    **({"document": {"text": body.documents[i]}} if body.return_documents else {})} for i in order]
        return {"id": new_id("rerank"), "model": self.model_name, "results": results,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def _similarities(self, firsts: list[str], seconds: list[str],
                            truncate: Optional[int]) -> tuple[list[list[float]], int]:
        """Cosine similarities [len(firsts)][len(seconds)] and the tokens read."""
        sequences = await self._tokenize([*firsts, *seconds], truncate, True, "documents")
        vectors = torch.stack(await self._vectors(sequences, None, None))
        unit = torch.nn.functional.normalize(vectors, dim=-1)
        similarity = unit[:len(firsts)] @ unit[len(firsts):].T
        return similarity.tolist(), sum(len(s) for s in sequences)

    async def _vectors(self, sequences: list[list[int]], dimensions: Optional[int],
                       param: Optional[str]) -> list[torch.Tensor]:
        try:
            return await self.engine.embed(sequences, dimensions)
        except ValueError as exc:
            raise APIError(400, str(exc), param=param if "dimensions" in str(exc) else None) from None

    async def _tokenize(self, inputs: list[Union[str, list[int]]], truncate: Optional[int],
                        add_special_tokens: bool, param: str) -> list[list[int]]:
        """Each input's token ids (EmbeddingModel.input_tokens), checked against the model."""
        try:
            sequences = await asyncio.to_thread(self.model.input_tokens, inputs, truncate, add_special_tokens)
        except ValueError as exc:
            raise APIError(400, str(exc), param="truncate_prompt_tokens") from None
        for index, tokens in enumerate(sequences):
            try:
                self.model.check_tokens(tokens)
            except ValueError as exc:
                raise APIError(400, f"{param}[{index}]: {exc}", param=param) from None
        return sequences


def _encoded(vector: torch.Tensor, encoding_format: str) -> Union[list[float], str]:
    if encoding_format == "base64":  # OpenAI's: the float32 values' bytes, little-endian
        return base64.b64encode(vector.float().numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
