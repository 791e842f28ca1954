"""Request bodies of the embedding routes: OpenAI's /v1/embeddings, and the /v1/score and /v1/rerank that
vLLM serves (Cohere's and Jina's rerank shape); strict, like the generation bodies."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field, model_validator

from tokenmill.server.protocol import _Body

# OpenAI's `input`: a string, a list of strings, a list of token ids, or a list of token-id lists
EmbeddingInput = Union[str, list[str], list[int], list[list[int]]]
TextOrTexts = Union[str, list[str]]


class _PoolingFields(_Body):
    model: Optional[str] = None
    user: Optional[str] = None
    # vLLM's: cut each input to its last k tokens (-1: to the model's limit) instead of refusing it
    truncate_prompt_tokens: Optional[int] = Field(None, ge=-1)
    priority: int = 0  # accepted as vLLM does; inputs are taken in arrival order


class EmbeddingRequest(_PoolingFields):
    """POST /v1/embeddings."""

    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    add_special_tokens: bool = True

    def inputs(self) -> list[Union[str, list[int]]]:
        """Each input: a text, or token ids."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and all(isinstance(v, int) for v in value):
            return [list(value)]
        return list(value)


class ScoreRequest(_PoolingFields):
    """POST /v1/score: `text_1` against each of `text_2` (one to one when both are lists of one length, one
    to many when text_1 is a single text); vLLM's `queries`/`documents` names are taken as well."""

    text_1: Optional[TextOrTexts] = None
    text_2: Optional[TextOrTexts] = None
    queries: Optional[TextOrTexts] = None
    documents: Optional[TextOrTexts] = None

    @model_validator(mode="after")
    def _one_naming(self) -> "ScoreRequest":
        if self.queries is not None or self.documents is not None:
            if self.text_1 is not None or self.text_2 is not None:
                raise ValueError("give text_1/text_2 or queries/documents, not both")
            self.text_1, self.text_2 = self.queries, self.documents
        if self.text_1 is None or self.text_2 is None:
            raise ValueError("'text_1' and 'text_2' are required")
        return self

    def pairs(self) -> list[tuple[str, str]]:
        """The (first, second) texts scored, in the response's order. ValueError when the shapes do not pair."""
        first = [self.text_1] if isinstance(self.text_1, str) else list(self.text_1)
        second = [self.text_2] if isinstance(self.text_2, str) else list(self.text_2)
        if not first or not second:
            raise ValueError("text_1 and text_2 must not be empty")
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise ValueError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as "
                             "many as text_2")
        return list(zip(first, second))


class RerankRequest(_PoolingFields):
    """POST /v1/rerank (also /rerank and /v2/rerank): `documents` ordered by relevance to `query`."""

    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int = Field(0, ge=0)  # 0: all of them
    return_documents: bool = True
