"""Shared test setup: make `tests/` importable so tests can `import helpers`."""

import sys
from pathlib import Path

TESTS_DIR = str(Path(__file__).parent)
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)
