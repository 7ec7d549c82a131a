"""Every relative link in the project's markdown resolves: the file or folder exists, and an `#anchor`
names a heading of the markdown file it points into (GitHub's slugs). No network: links with a
scheme (https:, mailto:) are left alone. `make lint` runs it.

    python -m tools.check_links [FILE ...]   # default: README.md, docs/*.md, deploy/README.md, BENCHMARKS.md

Prints one line per broken link (`file:line: link: why`) and exits 1 when there is any.
"""

from __future__ import annotations

import re
import sys
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ("README.md", "docs/*.md", "deploy/README.md", "BENCHMARKS.md")

# [text](target) and ![alt](target); the target ends at whitespace (a title may follow) or ")".
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _outside_fences(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    lines, fence = [], None
    for number, line in enumerate(text.split("\n"), 1):
        stripped = line.lstrip()
        if fence is None and stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
        elif fence is not None:
            if stripped.startswith(fence):
                fence = None
        else:
            lines.append((number, line))
    return lines


def _blank_code_spans(line: str) -> str:
    """The line with its inline code spans blanked: a link inside backticks is not a link."""
    return re.sub(r"(`+)(.+?)\1", lambda m: " " * len(m.group(0)), line)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: markup dropped, lower case, punctuation dropped
    (letters, marks, digits, `_`, `-` and spaces kept), spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.replace("`", "").lower()
    kept = []
    for ch in text:
        cat = unicodedata.category(ch)
        if ch in " -_" or cat[0] in "LMN":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a markdown file has: its headings' slugs (a repeated slug gets -1, -2, ...) and
    explicit `<a name=...>` / `<a id=...>`."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line in _outside_fences(path.read_text(encoding="utf-8")):
        out.update(_HTML_ANCHOR.findall(_blank_code_spans(line)))
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def check_file(path: Path, root: Path = ROOT) -> list[str]:
    """One message per broken relative link in the markdown file `path`."""
    problems = []
    cache: dict[Path, set[str]] = {}
    text = path.read_text(encoding="utf-8")
    shown = path.relative_to(root) if path.is_relative_to(root) else path
    for number, line in _outside_fences(text):
        for m in _LINK.finditer(_blank_code_spans(line)):
            target = m.group(1)
            if _SCHEME.match(target) or target.startswith("//"):
                continue
            file_part, _, anchor = target.partition("#")
            dest = path if not file_part else (path.parent / file_part).resolve()
            where = f"{shown}:{number}: {target}"
            if file_part and root not in dest.parents and dest != root:
                problems.append(f"{where}: points outside the repository")
                continue
            if not dest.exists():
                problems.append(f"{where}: no such file")
                continue
            if not anchor:
                continue
            if dest.is_dir() or dest.suffix.lower() != ".md":
                problems.append(f"{where}: an anchor into something that is not a markdown file")
                continue
            if dest not in cache:
                cache[dest] = anchors(dest)
            if anchor not in cache[dest]:
                problems.append(f"{where}: no heading #{anchor} in {dest.name}")
    return problems


def default_files(root: Path = ROOT) -> list[Path]:
    files: list[Path] = []
    for pattern in DEFAULT:
        files.extend(sorted(root.glob(pattern)))
    return files


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    args = sys.argv[1:] if argv is None else argv
    files = [Path(a).resolve() for a in args] if args else default_files(root)
    problems = [p for f in files for p in check_file(f, root)]
    for p in problems:
        print(p)
    if problems:
        print(f"check_links: {len(problems)} broken link(s) in {len(files)} file(s)", file=sys.stderr)
        return 1
    print(f"check_links: every relative link resolves ({len(files)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
