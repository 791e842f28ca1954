"""Structured output: constrained decoding with xgrammar (JSON schemas, regexes, choices, EBNF grammars)."""
