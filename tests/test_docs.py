"""The documentation cannot drift: the recipe reference is the schema's own text, every recipe field is documented,
and the README stays a five-minute read whose links resolve."""

import re
from pathlib import Path

from pretrainer.recipe.reference import doc_of, fields, reference_markdown

ROOT = Path(__file__).resolve().parents[1]


def test_every_recipe_field_is_documented():
    undocumented = [key for key, f, _ in fields() if not doc_of(f)]
    assert undocumented == [], f"recipe fields without a docstring: {undocumented}"


def test_recipe_reference_is_generated_from_the_schema():
    text = (ROOT / "docs" / "RECIPE_REFERENCE.md").read_text()
    assert text == reference_markdown(), "docs/RECIPE_REFERENCE.md is stale: run python scripts/recipe_reference.py"
    for key, _, _ in fields():
        assert f"| `{key}` |" in text or f"## `{key}`" in text, key


def test_readme_is_short_and_its_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), f"README links to missing {target}"
    assert "make run" in readme and "make test" in readme
    for doc in (ROOT / "docs").glob("*.md"):
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", doc.read_text()):
            if not target.startswith("http"):
                assert (doc.parent / target).exists() or (ROOT / target).exists(), f"{doc.name} links to {target}"
