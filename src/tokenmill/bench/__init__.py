"""Benchmarks shared by `tokenmill bench serve` (any OpenAI-compatible server) and `bench throughput` (in-process)."""
