"""Test helpers: tiny checkpoints (HF folders and GGUF files) built on the fly."""
