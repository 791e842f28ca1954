"""The engine: requests in, tokens and text out."""
