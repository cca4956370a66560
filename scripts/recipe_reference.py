"""Write the recipe reference (docs/RECIPE_REFERENCE.md) from the schema's field docstrings.

python scripts/recipe_reference.py            # rewrite docs/RECIPE_REFERENCE.md
python scripts/recipe_reference.py --check    # exit 1 when the file differs from the schema
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pretrainer.recipe.reference import reference_markdown

OUT = Path(__file__).resolve().parents[1] / "docs" / "RECIPE_REFERENCE.md"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true")
    args = p.parse_args(argv)
    text = reference_markdown()
    if args.check:
        same = OUT.exists() and OUT.read_text() == text
        print("up to date" if same else f"{OUT} differs from the schema: run python scripts/recipe_reference.py")
        return 0 if same else 1
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
