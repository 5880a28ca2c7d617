"""The package's imports keep the layer order written in docs/architecture.md: a unit (a top-level
module or subpackage of dspark) imports only units of lower layers, never one of its own layer or
above, so no cycle between packages can form. The order is read from the document's "Layers"
table, so the document and the code cannot drift apart."""

from __future__ import annotations

import ast
import importlib.util
import pkgutil
import re
from collections.abc import Iterable
from pathlib import Path

import pytest

import dspark

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def read_layers(doc: str) -> dict[str, int]:
    """unit -> layer (0 = the bottom) from the table under "## Layers": one row per layer, the top
    layer first, its units in backticks in the second column."""
    section = doc.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    rows = [r for r in rows[1:] if not re.fullmatch(r"[|\s:-]+", r)]  # drop the header and the rule
    layers = [re.findall(r"`([a-z_]+)`", row.split("|")[2]) for row in rows]
    ranks: dict[str, int] = {}
    for i, units in enumerate(layers):
        assert units, f"layer row without units: {rows[i]}"
        for unit in units:
            assert unit not in ranks, f"{unit} is listed in two layers"
            ranks[unit] = len(layers) - 1 - i
    return ranks


def imported_units(path: Path, module: list[str], package: str) -> Iterable[tuple[str, int]]:
    """(unit, line) of every import of ``package.<unit>`` in the file of ``module`` (all of them,
    at the top or inside functions; relative ones resolved)."""
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name.split(".") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module if is_pkg else module[:-1]
                base = base[: len(base) - node.level + 1]
            else:
                base = []
            target = base + (node.module.split(".") if node.module else [])
            # `from dspark import x` / `from .. import x` imports the units named.
            names = [target + [a.name] for a in node.names] if target == [package] else [target]
        else:
            continue
        for name in names:
            if len(name) > 1 and name[0] == package:
                yield name[1], node.lineno


def unit_files(package: str, unit: str) -> list[tuple[Path, list[str]]]:
    """The files of ``package.<unit>`` with their module names, wherever the unit is installed from."""
    spec = importlib.util.find_spec(f"{package}.{unit}")
    assert spec is not None, f"{package}.{unit} is listed in {DOC.name} but does not exist"
    if not spec.submodule_search_locations:
        return [(Path(spec.origin), [package, unit])]
    out = []
    for root in map(Path, spec.submodule_search_locations):
        for f in sorted(root.rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            out.append((f, [package, unit, *parts[:-1], *([] if parts[-1] == "__init__" else parts[-1:])]))
    return out


def violations(package: str, ranks: dict[str, int]) -> list[str]:
    """Every import against the order, and every cycle between units."""
    problems, graph = [], {u: set() for u in ranks}
    for unit in ranks:
        for path, module in unit_files(package, unit):
            for other, line in imported_units(path, module, package):
                if other == unit:
                    continue
                graph[unit].add(other)
                if other not in ranks:
                    problems.append(f"{path}:{line}: imports {package}.{other}, a unit no layer lists")
                elif ranks[other] >= ranks[unit]:
                    where = "its own layer" if ranks[other] == ranks[unit] else "a higher layer"
                    problems.append(f"{path}:{line}: {unit} imports {other}, from {where}")
    problems += [f"units in an import cycle: {', '.join(c)}" for c in cycles(graph)]
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of units that import each other, directly or around a loop (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on.discard(group[-1])
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_imports_follow_the_documented_layers():
    ranks = read_layers(DOC.read_text(encoding="utf-8"))
    present = {m.name for m in pkgutil.iter_modules(dspark.__path__)}
    assert sorted(present - set(ranks)) == [], f"units missing from the layer table in {DOC}"
    problems = violations("dspark", ranks)
    assert not problems, "\n".join(problems)


def test_lightning_stays_out_of_the_model_and_decoding_layers():
    """Drafters, objectives, the engines and everything under them run without Lightning."""
    ranks = read_layers(DOC.read_text(encoding="utf-8"))
    low = [u for u, r in ranks.items() if r <= ranks["decoding"]]
    offenders = [
        f"{path}:{node.lineno}"
        for unit in low
        for path, _ in unit_files("dspark", unit)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        and any(n.split(".")[0] == "lightning" for n in _module_names(node))
    ]
    assert not offenders, offenders


def _module_names(node: ast.Import | ast.ImportFrom) -> list[str]:
    return [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]


def test_the_checker_sees_upward_sideways_and_cyclic_imports(tmp_path, monkeypatch):
    """On a package built here: what the real test would catch, it catches."""
    pkg = tmp_path / "toy"
    files = {
        "__init__.py": "",
        "core/__init__.py": "",
        "core/io.py": "def f():\n    from ..drafters import base  # upward, inside a function\n",
        "drafters/__init__.py": "",
        "drafters/base.py": "from dspark import x\nfrom toy.core import io\n",
        "decoding.py": "from . import scheduling\n",
        "scheduling.py": "import toy.decoding\n",
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    ranks = {"decoding": 2, "scheduling": 2, "drafters": 1, "core": 0}
    problems = violations("toy", ranks)
    assert any("core/io.py:2: core imports drafters, from a higher layer" in p for p in problems)
    assert any("decoding.py:1: decoding imports scheduling, from its own layer" in p for p in problems)
    assert any("scheduling.py:1: scheduling imports decoding, from its own layer" in p for p in problems)
    assert "units in an import cycle: core, drafters" in problems
    assert "units in an import cycle: decoding, scheduling" in problems
    assert len(problems) == 5  # drafters -> core is fine; dspark is another package
    assert violations("toy", {"decoding": 3, "scheduling": 2, "drafters": 1, "core": 0}) != []
    assert violations("toy", {"core": 3, "decoding": 2, "scheduling": 1, "drafters": 0}) != []


def test_the_layer_table_is_read_top_down():
    table = "| layer | units | owns |\n|---|---|---|\n| top | `a` `b` | … |\n| bottom | `c` | … |\n"
    doc = "x\n## Layers\n\n" + table + "\n## Next\n| ignored | `d` | |\n"
    assert read_layers(doc) == {"a": 1, "b": 1, "c": 0}
    with pytest.raises(AssertionError, match="two layers"):
        read_layers(doc.replace("`c`", "`a`"))
