"""Shared test setup: make `tests/` importable so tests can `import helpers`."""

import os
import sys
from pathlib import Path

# no GPU here: Triton kernels (the triton_paged backend) run in Triton's interpreter on CPU tensors. Triton
# reads this when it is first imported, so it is set before any test imports it.
os.environ.setdefault("TRITON_INTERPRET", "1")

TESTS_DIR = str(Path(__file__).parent)
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)
