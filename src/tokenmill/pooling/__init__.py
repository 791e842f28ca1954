"""Embedding models: encoders and decoders whose pooled final states are the output (no generation)."""
