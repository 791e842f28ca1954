"""The `tokenmill` command."""
