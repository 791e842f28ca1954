"""Model architectures and their loading."""
