"""The documentation cannot drift: the recipe reference is the schema's own text, every recipe field is documented,
and the README stays a five-minute read whose links resolve."""

import os
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


# Development history (our issue numbers, commit hashes, "this round") belongs in CHANGELOG.md; an upstream
# project's issue or PR, named with its project, is a reference and stays.
HISTORY = re.compile(r"(?i)(?<![\w/] )\b(?:issue|PR) #?\d+|\b(?:this|last|previous) (?:round|stop)\b")
HASH = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


def test_user_docs_carry_no_development_history():
    found = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        for m in [*HISTORY.finditer(text), *HASH.finditer(text)]:
            before = text[max(0, m.start() - 40) : m.start()]
            if re.search(r"(?:DeepSpeed|Megatron|torchtitan|transformers|accelerate)\W*$", before, re.I):
                continue
            found.append(f"{doc.name}: ...{before[-30:]}{m.group()}")
    assert found == [], "development history in the user docs (move it to CHANGELOG.md):\n" + "\n".join(found)


def test_architecture_names_every_module():
    """docs/ARCHITECTURE.md's table is the map of the library: a module it does not name is one a reader cannot find."""
    table = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    missing = [
        f"{p.parent.name}/{p.name}"
        for p in sorted((ROOT / "src" / "pretrainer").glob("*/*.py"))
        if p.name != "__init__.py" and f"`{p.name}`" not in table
    ]
    assert missing == [], f"modules docs/ARCHITECTURE.md does not name: {missing}"


def test_the_launch_table_names_tests_that_exist():
    """docs/CLUSTER.md's feature x launch table: every test a "yes" points to exists, so a renamed or deleted test
    turns its cell into a failure here instead of a claim nobody checks."""
    text = (ROOT / "docs" / "CLUSTER.md").read_text()
    section = text[text.index("## What each launch supports") : text.index("## What every node must share")]
    named = re.findall(r"`(tests/test_\w+\.py)::(test_\w+)`", section)
    assert len(named) >= 20
    missing = [f"{f}::{t}" for f, t in named if f"def {t}(" not in (ROOT / f).read_text()]
    assert missing == [], missing
    table = section[section.index("| feature") : section.index("\n\n- ")]
    defined = set(re.findall(r"\b([A-Z]\d)\s+`tests/", section))
    assert set(re.findall(r"\b([A-Z]\d)\b", table)) <= defined  # every code a cell uses points to a test


def test_make_install_takes_the_documented_torch_build():
    """`TORCH=cpu` (the default) installs from torch's CPU index, `cuda` from the package index, `pip` from the
    configured sources; anything else stops before installing (`make -n`: the commands, nothing run)."""
    import subprocess

    def torch_line(*args: str) -> str:
        proc = subprocess.run(
            ["make", "-n", "-B", "install", "VENV=/nonexistent/venv", *args], cwd=ROOT, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr
        return next(line for line in proc.stdout.splitlines() if "install torch==" in line)

    cpu = "--index-url https://download.pytorch.org/whl/cpu"
    env = {k: v for k, v in os.environ.items() if k != "TORCH"}  # .ci/run exports TORCH=pip
    assert cpu in torch_line("TORCH=cpu") and cpu not in torch_line("TORCH=cuda")
    assert "--index-url" not in torch_line("TORCH=pip")
    proc = subprocess.run(["make", "-n", "-B", "install", "TORCH=gpu"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode != 0 and "TORCH=gpu: choose cpu, cuda or pip" in proc.stderr
    default = subprocess.run(["make", "-n", "-B", "install"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert cpu in default.stdout  # no TORCH given: the CPU build
    readme = (ROOT / "README.md").read_text()
    assert "TORCH=cpu" in readme and "TORCH=cuda" in readme and "TORCH=pip" in readme
