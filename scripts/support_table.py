"""README's table of what each architecture supports (tokenmill/support_table.py), printed or written.

    .venv/bin/python scripts/support_table.py            # print the generated block
    .venv/bin/python scripts/support_table.py --write    # rewrite README's block between its markers

tests/unit/test_support_table.py fails while README's block differs from the generated one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's package, not an installed one

from tokenmill.support_table import support_table_markdown, with_generated_block  # noqa: E402

README = Path(__file__).resolve().parents[1] / "README.md"


def main() -> None:
    """Print the block, or with --write rewrite README's."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="rewrite README.md's block between its markers")
    args = parser.parse_args()
    if not args.write:
        print(support_table_markdown(), end="")
        return
    text = README.read_text(encoding="utf-8")
    updated = with_generated_block(text)
    if updated != text:
        README.write_text(updated, encoding="utf-8")
    print(f"{README}: support table {'rewritten' if updated != text else 'already current'}")


if __name__ == "__main__":
    main()
