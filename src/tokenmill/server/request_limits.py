"""Bounds on the work one request may bring, checked before any of it is done (400 naming the field)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenmill.config import ServerConfig
from tokenmill.server.serving_common import APIError

MAX_STOP_CHARS = 1024


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for (the server's flags; docs/reliability.md lists them)."""

    max_prompts: int = 64
    max_stop_strings: int = 64
    max_logit_bias: int = 1024
    max_tools: int = 128
    max_constraint_bytes: int = 64 * 1024

    @classmethod
    def from_config(cls, config: ServerConfig) -> "RequestLimits":
        """The limits a server runs with."""
        return cls(config.max_prompts_per_request, config.max_stop_strings, config.max_logit_bias,
                   config.max_tools, int(config.max_constraint_kb * 1024))

    def check(self, body: Any) -> None:
        """Raise a 400 APIError naming the first field of a completions or chat body past its bound."""
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        _bound(len(stops), self.max_stop_strings, "stop", "stop strings")
        long = [s for s in stops if len(s) > MAX_STOP_CHARS]
        if long:
            raise APIError(400, f"stop strings may have at most {MAX_STOP_CHARS} characters; one has "
                                f"{len(long[0])}", param="stop")
        _bound(len(body.logit_bias or {}), self.max_logit_bias, "logit_bias", "entries")
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "response_format"):
            value = getattr(body, name)
            if value is not None:
                self._constraint_size(name, value)
        tools = getattr(body, "tools", None) or []
        _bound(len(tools), self.max_tools, "tools", "tools")
        for index, tool in enumerate(tools):
            if tool.function.parameters is not None:
                self._constraint_size(f"tools.{index}.function.parameters", tool.function.parameters)

    def check_prompts(self, count: int) -> None:
        """Raise a 400 APIError when a completions request has too many prompts."""
        _bound(count, self.max_prompts, "prompt", "prompts")

    def _constraint_size(self, name: str, value: Any) -> None:
        if hasattr(value, "model_dump"):
            value = value.model_dump(by_alias=True, exclude_none=True)
        text = value if isinstance(value, str) else json.dumps(value)
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.max_constraint_bytes:
            raise APIError(400, f"'{name}' is {size} bytes; this server takes at most "
                                f"{self.max_constraint_bytes} bytes per constraint or schema", param=name)


def _bound(count: int, limit: int, param: str, what: str) -> None:
    if count > limit:
        raise APIError(400, f"'{param}' has {count} {what}; this server takes at most {limit}", param=param)
