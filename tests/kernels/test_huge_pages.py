"""Large tensors sit on transparent huge pages once tokenmill is imported (see tokenmill/__init__.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# Imports tokenmill, then torch, fills a 16 MB tensor and prints the kB of huge pages backing it.
PROBE = """
import tokenmill, torch
x = torch.ones(16 << 20, dtype=torch.uint8)
start, end = x.data_ptr(), x.data_ptr() + x.numel()
huge, inside = 0, False
for line in open("/proc/self/smaps"):
    head = line.split()[0]
    if "-" in head and not head.endswith(":"):
        low, high = (int(v, 16) for v in head.split("-"))
        inside = low < end and high > start
    elif inside and head == "AnonHugePages:":
        huge += int(line.split()[1])
print(huge)
"""


def thp_mode() -> str:
    text = THP_MODE.read_text() if THP_MODE.exists() else ""
    return text[text.index("[") + 1:text.index("]")] if "[" in text else "never"


def huge_kb(env_value: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(thp_mode() == "never", reason="this kernel has transparent huge pages turned off")
def test_large_tensors_get_huge_pages_by_default():
    assert huge_kb(None) >= 2048


@pytest.mark.skipif(thp_mode() != "madvise", reason="only a kernel in madvise mode lets the process choose")
def test_the_user_can_keep_small_pages():
    assert huge_kb("0") == 0
