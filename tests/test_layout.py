"""The library stays readable: subpackages by concern, modules of one sitting, public names across modules, no import
cycles, no function-level imports of the package."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "pretrainer"

LEAVES = {"errors", "files", "runtime", "faults", "stats", "strict", "noise"}
"""Cross-cutting modules at the top of the package; they import no subpackage."""
RANKS = {
    **dict.fromkeys(LEAVES, 0),
    "model": 1,
    "recipe": 2,
    "data": 3,
    "observe": 4,
    "checkpoint": 5,
    "evaluation": 6,
    "stability": 7,
    "analysis": 8,
    "train": 9,
    "publishing": 10,
    "cli": 11,
}
"""The packages bottom-up (docs/ARCHITECTURE.md): each imports only those ranked below it, so the judgement
(`stability`, `analysis`) never reaches into the loop and storage never into policy."""


def modules() -> dict[str, ast.Module]:
    out = {}
    for p in sorted(SRC.rglob("*.py")):
        rel = p.relative_to(SRC.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        out[name] = (p, ast.parse(p.read_text()))
    return out


def resolve(module: str, node: ast.ImportFrom, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def test_layout_shows_the_architecture():
    """Subpackages by concern, each saying what it holds; only cross-cutting leaves at the top."""
    packages = {p.parent.name for p in SRC.glob("*/__init__.py")}
    assert packages == set(RANKS) - LEAVES - {"cli"}, packages
    for pkg in packages:
        assert ast.get_docstring(ast.parse((SRC / pkg / "__init__.py").read_text())), (
            f"{pkg}/__init__.py: no docstring"
        )
    top = {p.stem for p in SRC.glob("*.py")} - {"__init__"}
    assert top <= LEAVES | {"cli"}, f"modules at the top: {sorted(top)}"


def test_modules_are_formatted_honestly():
    """Formatted by ruff (checked by `make quality`); `# fmt: skip` only where an aligned table reads better.
    No cap on a module's lines (a cap made the trainer pack fields into tuples to stay under it): a module is split
    when a concern stands apart. Functions stay short, and the loop assigns one attribute per line."""
    skips = 0
    for path, tree in modules().values():
        text = path.read_text()
        skips += text.count("# fmt: skip")
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                assert n <= 80, f"{path}:{node.lineno} {node.name}() is {n} lines"
    assert skips <= 5, f"{skips} `# fmt: skip` markers in the library"
    loop = ast.parse((SRC / "train" / "trainer.py").read_text())
    packed = [
        node.lineno
        for node in ast.walk(loop)
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Tuple)
        and any(isinstance(e, ast.Attribute) for e in node.targets[0].elts)
    ]
    assert not packed, f"train/trainer.py: attributes assigned as a tuple at lines {packed}"


def test_no_private_imports_and_no_cycles():
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, (path, tree) in mods.items():
        is_pkg = path.name == "__init__.py"
        typing_only = {
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and getattr(block.test, "id", None) == "TYPE_CHECKING"
            for n in ast.walk(block)
        }
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or id(node) in typing_only:
                continue
            target = resolve(name, node, is_pkg)
            if not target.startswith("pretrainer"):
                continue
            for alias in node.names:
                assert not alias.name.startswith("_"), f"{path}: imports private {target}.{alias.name}"
            in_function = any(
                isinstance(p, ast.FunctionDef | ast.AsyncFunctionDef) and p.lineno <= node.lineno <= p.end_lineno
                for p in ast.walk(tree)
            )
            assert not in_function, f"{path}:{node.lineno}: a function-level import of {target}"
            for alias in node.names:  # `from . import checkpoint` names a module
                sub = f"{target}.{alias.name}"
                graph[name].add(sub if sub in mods else target)
    # depth-first search for a cycle among module-level imports (a package depends on what its __init__ imports)
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in graph.get(m, ()):
            if d == m or d not in mods or m.startswith(d + "."):
                continue  # a package's own modules importing siblings through it is not a cycle of modules
            assert state.get(d) != 1, f"import cycle: {' -> '.join(stack + [d])}"
            if d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in mods:
        if m not in state:
            visit(m, [m])


def package_of(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def test_packages_import_only_packages_below_them():
    """The rank table holds at run time (imports under TYPE_CHECKING included: a type from above is a dependency
    too); a package cycle is an import of a package ranked at or above the importer."""
    upward = []
    for name, (path, tree) in modules().items():
        own = package_of(name)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            target = resolve(name, node, path.name == "__init__.py")
            if not target.startswith("pretrainer"):
                continue
            targets = [target] if target != "pretrainer" else [f"pretrainer.{a.name}" for a in node.names]
            for t in targets:
                other = package_of(t)
                if other != own and RANKS[other] >= RANKS[own]:
                    upward.append(f"{path.relative_to(SRC)}:{node.lineno}: {own} imports {other}")
    assert not upward, "\n".join(upward)
    assert set(RANKS) == {package_of(m) for m in modules()}, "a package or leaf missing from RANKS"
