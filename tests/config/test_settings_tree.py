"""The drawing of the settings tree in services/config/__init__.py is the code's: every settings
class of the package is drawn, in the module the drawing names, with its bases in their order, and
each shared group is where the drawing says it lives."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pydantic

import services.config

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted(p.stem for p in (ROOT / "services" / "config").glob("*.py") if p.stem != "__init__")


def _drawing() -> tuple[dict[str, str], dict[str, tuple[str, list[str]]]]:
    """(shared group -> its file, class -> (its module, its bases)) as the docstring draws them."""
    groups, tree, module = {}, {}, None
    for line in services.config.__doc__.splitlines():
        if m := re.fullmatch(r"    ([\w, ]+?)\s{2,}(\S+\.py)\s{2,}.+", line):
            for name in m.group(1).split(", "):
                groups[name] = m.group(2)
        elif m := re.fullmatch(r"    (?:(\w+)\.py)?\s+(\w+)\(([\w, ]*)\)", line):
            module = m.group(1) or module
            tree[m.group(2)] = (module, m.group(3).split(", "))
    return groups, tree


def _classes() -> dict[str, type]:
    out = {}
    for name in MODULES:
        mod = importlib.import_module(f"services.config.{name}")
        for cls_name, cls in vars(mod).items():
            if (
                inspect.isclass(cls)
                and cls.__module__ == mod.__name__
                and issubclass(cls, pydantic.BaseModel)
            ):
                out[cls_name] = cls
    return out


def test_every_settings_class_is_drawn_with_its_bases_and_module():
    _, tree = _drawing()
    classes = _classes()
    assert sorted(tree) == sorted(classes)
    for name, (module, bases) in tree.items():
        cls = classes[name]
        assert cls.__module__ == f"services.config.{module}", name
        assert [b.__name__ for b in cls.__bases__] == bases, name


def test_the_shared_groups_live_where_the_drawing_says():
    groups, tree = _drawing()
    drawn_bases = {b for _, bases in tree.values() for b in bases} - set(tree) - {"BaseModel"}
    assert drawn_bases <= set(groups), drawn_bases - set(groups)
    classes = _classes()
    for name, path in groups.items():
        # Found through the classes that use it (or, for SettingsGroup, through Settings).
        owner = next((b for c in classes.values() for b in inspect.getmro(c) if b.__name__ == name), None)
        assert owner is not None, name
        assert Path(inspect.getfile(owner)).resolve() == (ROOT / path).resolve(), name
