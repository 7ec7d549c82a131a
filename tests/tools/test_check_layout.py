"""tools/check_layout.py holds the code against layout.toml: each rule is broken once in a small tree
and named in the answer, and this checkout keeps its own layout."""

from __future__ import annotations

from pathlib import Path

from tools import check_layout

ROOT = Path(__file__).resolve().parents[2]

LAYOUT = """
[limits]
function_code_lines = 5
engine_class_lines = 6

[packages.spopp]
role = "the library"

[packages."services.launch"]
role = "one run"
max_lines = 40
max_floors = 2
"""


def _tree(tmp_path: Path, files: dict[str, str], layout: str = LAYOUT) -> Path:
    (tmp_path / "layout.toml").write_text(layout)
    for name, text in {"spopp/__init__.py": "", "services/launch/__init__.py": "", **files}.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_a_tree_that_keeps_its_layout_passes(tmp_path):
    root = _tree(tmp_path, {"services/launch/a.py": "X = 1\n", "services/launch/b.py": "from .a import X\n"})
    assert check_layout.check(root) == []
    assert check_layout.main(["--root", str(root)]) == 0


def test_unlisted_and_vanished_packages_are_named(tmp_path):
    layout = LAYOUT + '\n[packages."runtime.gone"]\nrole = "was here"\n'
    root = _tree(tmp_path, {"services/extra/__init__.py": ""}, layout)
    problems = check_layout.check(root)
    assert "services.extra: a package that layout.toml does not list: add it with its role" in problems
    assert "runtime.gone: listed in layout.toml but not in the code" in problems
    assert check_layout.main(["--root", str(root)]) == 1


def test_floors_count_every_spelling_of_a_sibling_import(tmp_path):
    # c -> b -> a is three floors, over the bound of 2, whichever way the import is written.
    for spell in (
        "from .b import Y",
        "from services.launch.b import Y",
        "from . import b",
        "import services.launch.b",
    ):
        root = _tree(tmp_path, {
            "services/launch/a.py": "X = 1\n",
            "services/launch/b.py": "from services.launch import a\nY = a.X\n",
            "services/launch/c.py": f"def f():\n    {spell}\n",
        })  # fmt: skip
        assert check_layout.check(root) == [
            "services.launch: 3 floors (at most 2; c.py stands on floor 3)"
        ], spell


def test_a_circle_is_named_and_lines_are_bounded(tmp_path):
    root = _tree(tmp_path, {
        "services/launch/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import Y\n",
        "services/launch/b.py": "from .a import X\n" + "Z = 0\n" * 40,
    })  # fmt: skip
    problems = check_layout.check(root)
    assert "services.launch: modules import each other round a circle: a, b" in problems
    assert "services.launch: 44 lines in its modules (at most 40)" in problems


def test_long_functions_and_engine_classes_are_named(tmp_path):
    body = "    x = 1\n" * 6
    doc = '    """A docstring\n    of two lines is not code."""\n'
    root = _tree(tmp_path, {
        "spopp/ok.py": "def short():\n" + doc + "    # a comment is not code\n\n" + "    x = 1\n" * 5,
        "spopp/long.py": "def long():\n" + body,
        "runtime/__init__.py": "",
        "runtime/engines/__init__.py": "",
        "runtime/engines/big.py": "class Engine:\n" + "    a = 1\n" * 6,
        "runtime/other.py": "class NotAnEngine:\n" + "    a = 1\n" * 20,
    }, LAYOUT + '\n[packages.runtime]\nrole = "r"\n[packages."runtime.engines"]\nrole = "e"\n')  # fmt: skip
    assert check_layout.check(root) == [
        "spopp/long.py:1: long has 6 code lines (at most 5)",
        "runtime/engines/big.py:1: engine class Engine has 7 lines (at most 6)",
    ]


def test_this_checkout_keeps_its_layout():
    assert check_layout.check(ROOT) == []


def test_the_map_of_the_house_is_drawn_from_the_layout_and_kept_in_step(tmp_path):
    doc = f"# Development\n\n{check_layout.MAP_BEGIN}\nan old map\n{check_layout.MAP_END}\n\nthe rest\n"
    root = _tree(tmp_path, {"docs/development.md": doc, "spopp/maths.py": "X = 1\n"})
    assert check_layout.check(root) == [
        "docs/development.md: the map of the house differs from layout.toml: python -m tools.check_layout --write-map"
    ]
    assert check_layout.main(["--root", str(root), "--write-map"]) == 0
    text = (root / "docs" / "development.md").read_text()
    assert "| `services/launch/` | one run | – |" in text and "| `spopp/` | the library | – |" in text
    assert text.endswith("\n\nthe rest\n") and "an old map" not in text
    # A role changed in layout.toml is a map out of step until it is redrawn.
    (root / "layout.toml").write_text(LAYOUT.replace('role = "one run"', 'role = "one run, supervised"'))
    assert check_layout.check(root)[0].startswith("docs/development.md: the map of the house differs")
    # A start must name files that are there; the doc without its markers has no map to keep.
    (root / "layout.toml").write_text(
        LAYOUT.replace('role = "the library"', 'role = "l"\nstart = "maths.py, gone.py"')
    )
    (root / "docs" / "development.md").write_text("# Development\n")
    assert check_layout.check(root) == [
        "spopp: its start names gone.py, which is not in spopp",
        "docs/development.md: no map of the house (its markers are gone): put them back and --write-map",
    ]


def test_tools_is_a_listed_package_and_deploys_scripts_are_held_to_the_size_rules(tmp_path):
    root = _tree(tmp_path, {"tools/__init__.py": "", "deploy/up.py": "def main():\n" + "    x = 1\n" * 6})
    assert check_layout.check(root) == [
        "tools: a package that layout.toml does not list: add it with its role",
        "deploy/up.py:1: main has 6 code lines (at most 5)",
    ]


def test_a_folder_of_scripts_keeps_its_import_rules(tmp_path):
    layout = (
        LAYOUT
        + '\n[scripts.deploy]\nrole = "d"\nstdlib_only = ["host.py", "gone.py"]\nforbid = ["services"]\n'
    )
    root = _tree(tmp_path, {
        "deploy/host.py": "import json\nimport yaml\nimport step\n",  # step: a sibling script
        "deploy/step.py": "from services.launch import run\nfrom spopp import stats\n",
    }, layout)  # fmt: skip
    assert check_layout.check(root) == [
        "deploy/host.py: runs under the host's python3 but imports yaml",
        "deploy/gone.py: listed as stdlib_only in layout.toml but not there",
        "deploy/step.py: imports services, which deploy/ may not",
    ]
