"""The house's layout (DESIGN.md, "Layout: a family is a folder"), held by its imports: a lower layer
never imports a higher one, families depend on each other without cycles, the oracles import no
Triton, and ``import lanekit`` loads no kernel and no registry."""

import ast
import subprocess
import sys
from pathlib import Path

from lanekit.families import FAMILIES

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "lanekit"

# Lowest first; a module may import lanekit modules of its own layer or lower ones.
LAYERS = (
    ("runtime",),                        # the machinery: registry types, lanes, tuning lookup, targets
    ("common", "reference"),             # shared numerics (Triton) and the oracles (plain PyTorch)
    ("testing",),                        # the tolerance rule, poisoning, sample helpers
    FAMILIES,                            # the op families, each a folder
    ("families",),                       # the one list of families
    ("check", "matrix", "export", "cli", "demo", "integrations", "compat", "__main__", "__init__"),
)


def _unit(module: str) -> str:
    """lanekit.attention.kernels.fwd -> attention; lanekit -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(unit: str) -> int:
    [index] = [i for i, names in enumerate(LAYERS) if unit in names]
    return index


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, path


def _imports(name: str, path: Path):
    """Every lanekit module that ``name`` imports (at the top or inside a function)."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.split(".")[0] == "lanekit")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] == "lanekit":
                yield module


def test_every_module_belongs_to_a_layer():
    units = {_unit(name) for name, _ in _modules()}
    placed = {u for names in LAYERS for u in names}
    assert units <= placed, f"modules outside the layers of tests/test_layout.py: {sorted(units - placed)}"


def test_no_module_imports_a_higher_layer():
    upward = []
    for name, path in _modules():
        mine = _layer(_unit(name))
        for imported in _imports(name, path):
            if _layer(_unit(imported)) > mine:
                upward.append(f"{name} imports {imported}")
    assert not upward, "a lower layer imports a higher one:\n" + "\n".join(upward)


def test_families_depend_on_each_other_without_cycles():
    edges = {f: set() for f in FAMILIES}
    for name, path in _modules():
        unit = _unit(name)
        if unit in edges:
            edges[unit] |= {_unit(m) for m in _imports(name, path) if _unit(m) in edges and _unit(m) != unit}

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, seen + (n,))) for n in edges[start])

    cycles = sorted(f for f in FAMILIES if reaches(f, f))
    assert not cycles, f"families in an import cycle: {cycles} ({edges})"


def test_the_oracles_import_no_triton_and_no_other_layer():
    for name, path in _modules():
        if _unit(name) != "reference":
            continue
        tree = ast.parse(path.read_text())
        imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in imported if m.split(".")[0] == "triton"], f"{name} imports Triton"
        assert all(_unit(m) == "reference" for m in _imports(name, path)), f"{name} imports outside reference"


def test_importing_lanekit_loads_no_kernel_and_no_registry():
    code = ("import sys, lanekit; print(sorted(m for m in sys.modules if m.split('.')[0] == 'triton' or "
            "(m.startswith('lanekit.') and m.split('.')[-1] in ('kernels', 'registry', 'families') "
            "and m != 'lanekit.runtime.registry') or '.kernels.' in m))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", f"import lanekit loaded {loaded.strip()}"
