"""Write spopp's installed-package metadata (a .dist-info folder) for the images.

The images run spopp from /app on PYTHONPATH, not pip-installed, so nothing would tell
`importlib.metadata` about the entry points that name spopp's own environments (the group
`spopp.environments` of pyproject.toml: runtime/envs/registry.py finds `toy-calc` there, as it
finds a user's plug-in). This writes what `pip install` would: METADATA and entry_points.txt, from
pyproject.toml, into OUT (the folder on PYTHONPATH).

    python3 dist_info.py pyproject.toml OUT
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def main(pyproject: str, out: str) -> None:
    project = tomllib.loads(Path(pyproject).read_text())["project"]
    folder = Path(out) / f"{project['name']}-{project['version']}.dist-info"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    lines = []
    groups = dict(project.get("entry-points", {}))
    if project.get("scripts"):
        groups["console_scripts"] = project["scripts"]
    for group, entries in groups.items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {value}" for name, value in entries.items()]
        lines.append("")
    (folder / "entry_points.txt").write_text("\n".join(lines))
    print(f"wrote {folder}")


if __name__ == "__main__":
    main(*sys.argv[1:])
