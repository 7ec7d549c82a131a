"""Hold the code against layout.toml (part of `make lint`).

    python -m tools.check_layout [--root DIR] [--write-map]

Checks, each failure one line naming the file or package and the bound:
- every package (a folder with __init__.py) under spopp/, runtime/, services/ and tools/ is listed
  in layout.toml with its role, and every listed package exists;
- a package with `max_lines` holds at most that many lines (its own modules, not its subpackages);
- a package with `max_floors`: its modules, ordered by their imports of one another, stand on at
  most that many floors (a module importing no sibling is floor 1, one importing a floor-n sibling
  is floor n + 1), and no two of them import each other round a circle;
- no function (deploy/'s scripts included) has more than `function_code_lines` code lines, and no
  class under runtime/engines more than `engine_class_lines` lines;
- a folder of scripts (`[scripts.<folder>]`): its `stdlib_only` files import the standard library
  and their siblings alone, and none of its files imports a top-level package `forbid` names;
- every file a package's `start` names exists, and docs/development.md's map of the house (between
  its two markers) is the one this file draws from layout.toml (`--write-map` redraws it).
Imports are read from the source (every import statement, TYPE_CHECKING ones included: a reader
follows those too); nothing is imported or run.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOTS = ("spopp", "runtime", "services", "tools")
# Held to the same size rules, though not packages of the product: the deployment's scripts.
SIZED = (*ROOTS, "deploy")
LAYOUT = "layout.toml"
MAP_DOC = Path("docs") / "development.md"
MAP_BEGIN = (
    "<!-- the map of the house: drawn from layout.toml by `python -m tools.check_layout --write-map` -->"
)
MAP_END = "<!-- end of the map -->"


def packages(root: Path) -> set[str]:
    """Dotted names of the packages under ROOTS (folders with an __init__.py; `services` itself is
    a namespace and not one)."""
    found = set()
    for top in ROOTS:
        for init in (root / top).rglob("__init__.py"):
            found.add(".".join(init.parent.relative_to(root).parts))
    return found


def modules(root: Path, package: str) -> dict[str, Path]:
    """The package's own modules (no subpackages), by name, __init__ left out."""
    folder = root.joinpath(*package.split("."))
    return {p.stem: p for p in sorted(folder.glob("*.py")) if p.name != "__init__.py"}


def sibling_imports(path: Path, package: str, names: set[str]) -> set[str]:
    """The modules of `package` (among `names`) that the module at `path` imports, however spelled:
    `from .x import`, `from . import x`, `from package.x import`, `from package import x`,
    `import package.x`."""
    got: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level == 1 or (node.level == 0 and (base == package or base.startswith(package + "."))):
                rest = base if node.level == 1 else base[len(package) :].lstrip(".")
                if rest:
                    got.add(rest.split(".")[0])
                else:  # from . import x / from package import x
                    got.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(package + "."):
                    got.add(a.name[len(package) + 1 :].split(".")[0])
    return got & names - {path.stem}


@dataclass
class Floors:
    floors: dict[str, int]
    circles: list[list[str]]


def floors(graph: dict[str, set[str]]) -> Floors:
    """Floor of each module of an import graph (module -> modules it imports), and the circles
    (strongly connected groups of two or more; their members are given the group's floor)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    # Tarjan emits a group after every group it depends on: floors in one pass.
    group_of = {m: i for i, g in enumerate(groups) for m in g}
    floor_of_group: list[int] = []
    for i, g in enumerate(groups):
        below = [floor_of_group[group_of[w]] for m in g for w in graph[m] if group_of[w] != i]
        floor_of_group.append(1 + max(below, default=0))
    return Floors({m: floor_of_group[group_of[m]] for m in graph}, [g for g in groups if len(g) > 1])


def code_lines(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Non-blank, non-comment lines of a function's body after its docstring."""
    body = node.body
    first = body[0]
    docstring = (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    )
    start = first.end_lineno + 1 if docstring else first.lineno
    return sum(
        1 for line in lines[start - 1 : node.end_lineno] if line.strip() and not line.strip().startswith("#")
    )


def check_sizes(root: Path, limits: dict) -> list[str]:
    problems = []
    fn_max, engine_max = limits["function_code_lines"], limits["engine_class_lines"]
    for top in SIZED:
        for path in sorted((root / top).rglob("*.py")):
            text = path.read_text()
            lines = text.splitlines()
            rel = path.relative_to(root)
            in_engines = rel.parts[:2] == ("runtime", "engines")
            for node in ast.walk(ast.parse(text, str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    n = code_lines(lines, node)
                    if n > fn_max:
                        problems.append(
                            f"{rel}:{node.lineno}: {node.name} has {n} code lines (at most {fn_max})"
                        )
                elif in_engines and isinstance(node, ast.ClassDef):
                    n = node.end_lineno - node.lineno + 1
                    if n > engine_max:
                        problems.append(
                            f"{rel}:{node.lineno}: engine class {node.name} has {n} lines (at most {engine_max})"
                        )
    return problems


def check_package(root: Path, name: str, entry: dict) -> list[str]:
    problems = []
    mods = modules(root, name)
    if "max_lines" in entry:
        total = sum(len(p.read_text().splitlines()) for p in mods.values())
        if total > entry["max_lines"]:
            problems.append(f"{name}: {total} lines in its modules (at most {entry['max_lines']})")
    if "max_floors" in entry:
        graph = {m: sibling_imports(p, name, set(mods)) for m, p in mods.items()}
        result = floors(graph)
        top = max(result.floors.values(), default=0)
        if top > entry["max_floors"]:
            chain = sorted(result.floors, key=lambda m: -result.floors[m])[0]
            problems.append(
                f"{name}: {top} floors (at most {entry['max_floors']}; {chain}.py stands on floor {top})"
            )
        for circle in result.circles:
            problems.append(f"{name}: modules import each other round a circle: {', '.join(circle)}")
    return problems


def house_map(listed: dict[str, dict], scripts: dict[str, dict] | None = None) -> str:
    """The map of the house: one row a package (and a folder of scripts), in the order of their
    folders, with what it holds and where a newcomer starts reading it."""
    rows = ["| folder | what it holds | start at |", "|---|---|---|"]
    folders = {name.replace(".", "/"): entry for name, entry in {**listed, **(scripts or {})}.items()}
    for folder in sorted(folders, key=lambda f: f.split("/")):
        entry = folders[folder]
        rows.append(f"| `{folder}/` | {entry.get('role', '')} | {entry.get('start', '–')} |")
    return "\n".join(rows)


def _starts(root: Path, listed: dict[str, dict]) -> list[str]:
    """Every file a `start` names (a word ending in .py, relative to its package) must exist."""
    problems = []
    for name, entry in sorted(listed.items()):
        folder = root.joinpath(*name.split("."))
        for word in re.findall(r"[\w/]+\.py", str(entry.get("start", ""))):
            if folder.is_dir() and not (folder / word).is_file():
                problems.append(f"{name}: its start names {word}, which is not in {folder.relative_to(root)}")
    return problems


def _map_section(text: str) -> tuple[int, int] | None:
    """Where the map's rows lie in the doc's text (between the markers), or None without them."""
    begin, end = text.find(MAP_BEGIN), text.find(MAP_END)
    if begin < 0 or end < begin:
        return None
    return begin + len(MAP_BEGIN), end


def check_map(root: Path, listed: dict[str, dict], scripts: dict[str, dict]) -> list[str]:
    """The doc's map is the one drawn from layout.toml (a tree without the doc has none to check)."""
    doc = root / MAP_DOC
    if not doc.is_file():
        return []
    text = doc.read_text()
    span = _map_section(text)
    if span is None:
        return [f"{MAP_DOC}: no map of the house (its markers are gone): put them back and --write-map"]
    if text[span[0] : span[1]].strip() != house_map(listed, scripts):
        return [
            f"{MAP_DOC}: the map of the house differs from {LAYOUT}: python -m tools.check_layout --write-map"
        ]
    return []


def write_map(root: Path) -> None:
    """Redraw the doc's map from layout.toml (ValueError when the doc has no markers)."""
    doc = root / MAP_DOC
    text = doc.read_text()
    span = _map_section(text)
    if span is None:
        raise ValueError(f"{doc}: no markers {MAP_BEGIN!r} ... {MAP_END!r}")
    layout = tomllib.loads((root / LAYOUT).read_text())
    drawn = house_map(layout.get("packages", {}), layout.get("scripts", {}))
    doc.write_text(text[: span[0]] + "\n" + drawn + "\n" + text[span[1] :])


def _imported(path: Path) -> set[str]:
    """The top-level names of the modules a file imports (relative imports left out)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def check_scripts(root: Path, scripts: dict[str, dict]) -> list[str]:
    """A folder of scripts (not a package, so no import contract reaches it): its `stdlib_only`
    files import the standard library and their sibling scripts alone (they run under the host's
    python3, without the project's environment); no file of it imports what `forbid` names."""
    problems = []
    for folder, entry in sorted(scripts.items()):
        base = root / folder
        for name in entry.get("stdlib_only", []):
            path = base / name
            if not path.is_file():
                problems.append(f"{folder}/{name}: listed as stdlib_only in {LAYOUT} but not there")
                continue
            siblings = {p.stem for p in path.parent.glob("*.py")}
            extra = sorted(_imported(path) - set(sys.stdlib_module_names) - siblings - {"__future__"})
            if extra:
                problems.append(
                    f"{folder}/{name}: runs under the host's python3 but imports {', '.join(extra)}"
                )
        forbid = set(entry.get("forbid", []))
        for path in sorted(base.rglob("*.py")):
            if bad := sorted(_imported(path) & forbid):
                problems.append(
                    f"{path.relative_to(root)}: imports {', '.join(bad)}, which {folder}/ may not"
                )
    return problems


def check(root: Path) -> list[str]:
    layout_path = root / LAYOUT
    try:
        layout = tomllib.loads(layout_path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        return [f"{layout_path}: cannot read: {exc}"]
    listed = layout.get("packages", {})
    found = packages(root)
    problems = [
        f"{p}: a package that {LAYOUT} does not list: add it with its role"
        for p in sorted(found - set(listed))
    ]
    problems += [f"{p}: listed in {LAYOUT} but not in the code" for p in sorted(set(listed) - found)]
    problems += [
        f"{p}: no role in {LAYOUT}" for p, e in sorted(listed.items()) if not str(e.get("role", "")).strip()
    ]
    for name, entry in sorted(listed.items()):
        if name in found:
            problems += check_package(root, name, entry)
    scripts = layout.get("scripts", {})
    problems += (
        _starts(root, {**listed, **scripts}) + check_map(root, listed, scripts) + check_scripts(root, scripts)
    )
    return problems + check_sizes(root, layout["limits"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=Path("."), help="the checkout (default: here)")
    p.add_argument("--write-map", action="store_true", help=f"redraw {MAP_DOC}'s map of the house first")
    a = p.parse_args(argv)
    if a.write_map:
        write_map(a.root.resolve())
    problems = check(a.root.resolve())
    for line in problems:
        print(f"check_layout: {line}", file=sys.stderr)
    if problems:
        return 1
    print(f"check_layout: the code keeps {LAYOUT} ({len(packages(a.root.resolve()))} packages)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
