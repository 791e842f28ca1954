"""Compiling constraints into xgrammar grammars, once per distinct constraint, for one tokenizer."""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any, Optional

from tokenmill.structured.schema_checks import unsatisfiable
from tokenmill.structured.spec import StructuredOutput

# xgrammar's errors start with a timestamp and a source location: "[19:02:54] /project/cpp/x.cc:83: ..."
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
_LENGTH_LIMITED_CHAR = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHAR = '[^\\"\\\\\\x00-\\x1f]'
_WHAT = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regex", "choice": "choice list",
         "grammar": "grammar"}


def xgrammar_message(exc: Exception) -> str:
    """An xgrammar error's message without its timestamp and source location."""
    return _LOCATION.sub("", str(exc).strip())


def json_schema_ebnf(schema: str) -> str:
    """The EBNF grammar (start rule `root`) of JSON text matching `schema`, in compact separators.

    xgrammar (0.2.8) writes length-limited strings as [^"\\\r\n]{..}, which lets raw control characters
    into a JSON string (invalid JSON); the text is corrected here. Raises RuntimeError on a bad schema,
    one that no finite value satisfies included (schema_checks).
    """
    import xgrammar as xgr

    try:
        text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))  # its own errors name the keyword
    except RuntimeError:
        # a schema no finite value satisfies: ours names how (xgrammar 0.2.9 and later refuse $ref cycles
        # themselves, in fewer words)
        problem = _unsatisfiable_or_none(schema)
        if problem:
            raise RuntimeError(problem) from None
        raise
    problem = unsatisfiable(json.loads(schema))
    if problem:
        raise RuntimeError(problem)
    return text.replace(_LENGTH_LIMITED_CHAR, _JSON_STRING_CHAR)


def _unsatisfiable_or_none(schema: str) -> Optional[str]:
    """`unsatisfiable` of a schema xgrammar refused, or None where the check cannot read it either."""
    try:
        return unsatisfiable(json.loads(schema))
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return None


class GrammarCache:
    """Compiles StructuredOutputs for a tokenizer with xgrammar and keeps the `max_entries` most recently
    used results (a request's matcher holds its own reference, so eviction never breaks one in flight).

    Thread-safe: the server compiles on worker threads (off the engine loop) and the runner finds the
    result here. Invalid constraints raise ValueError naming what is wrong.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...],
                 max_entries: int = 256) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)
        self.vocab_size = vocab_size
        self._compiled: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self.num_compilations = 0

    def compile(self, spec: StructuredOutput) -> Any:
        """The xgrammar CompiledGrammar of `spec` (compiled on first use)."""
        spec = spec.grammar_key
        with self._lock:
            found = self._compiled.get(spec)
            if found is not None:
                self._compiled.move_to_end(spec)
                return found
        try:
            compiled = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's errors for what it cannot take
            raise ValueError(f"invalid {_WHAT[spec.kind]}: {xgrammar_message(exc)}") from None
        if not self._admits_something(compiled):
            raise ValueError(f"invalid {_WHAT[spec.kind]}: it admits no output (no token may start one)")
        with self._lock:
            self.num_compilations += 1
            compiled = self._compiled.setdefault(spec, compiled)
            while len(self._compiled) > self.max_entries:
                self._compiled.popitem(last=False)
            return compiled

    def _admits_something(self, compiled: Any) -> bool:
        """Whether a request under `compiled` could take a first token or end at once: a constraint that
        admits nothing would otherwise fail at generation, with every token forbidden."""
        matcher = self._xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        if matcher.is_terminated():
            return True
        bitmask = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        return bool(bitmask.any())

    def _compile(self, spec: StructuredOutput) -> Any:
        compiler = self.compiler
        if spec.kind == "json":
            return compiler.compile_grammar(json_schema_ebnf(spec.value))
        if spec.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.value)
        if spec.kind == "choice":
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in json.loads(spec.value)))
        return compiler.compile_grammar(spec.value)
