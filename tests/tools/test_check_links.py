"""tools/check_links.py (`make lint`): a broken relative link or anchor is reported, a good one is
not, and the project's own markdown has none."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import check_links
from tools.check_links import anchors, check_file, slug


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(
        "# A page\n\n## Bounded staleness: `max_staleness`\n\n## When does SPO++ beat SPO? `make map`\n\n"
        "## Logs\n\n## Logs\n\n```\n## not a heading\n```\n"
    )
    (tmp_path / "deploy").mkdir()
    (tmp_path / "deploy" / "Dockerfile").write_text("FROM scratch\n")
    return tmp_path


def test_github_slugs():
    assert slug("Bounded staleness: `max_staleness`") == "bounded-staleness-max_staleness"
    assert slug("When does SPO++ beat SPO? `make map`") == "when-does-spo-beat-spo-make-map"
    assert slug("The GPU tier: `make test-gpu`") == "the-gpu-tier-make-test-gpu"
    assert slug("Memory: token-budget micro-batches, and `spopp learner plan`") == (
        "memory-token-budget-micro-batches-and-spopp-learner-plan"
    )
    assert slug("A [linked](x.md) heading") == "a-linked-heading"


def test_anchors_number_repeats_and_skip_code(tree: Path):
    got = anchors(tree / "docs" / "page.md")
    assert {"a-page", "logs", "logs-1", "bounded-staleness-max_staleness"} <= got
    assert "not-a-heading" not in got


def test_good_links_are_not_reported(tree: Path):
    readme = tree / "README.md"
    readme.write_text(
        "# Top\n\nSee [the page](docs/page.md), [staleness](docs/page.md#bounded-staleness-max_staleness),\n"
        "[the map](docs/page.md#when-does-spo-beat-spo-make-map), [logs twice](docs/page.md#logs-1),\n"
        '[up here](#top), [a folder](deploy/), ![an image](deploy/Dockerfile "title") and\n'
        "[the web](https://example.com/nowhere.md#x), [mail](mailto:a@b.c).\n"
    )
    assert check_file(readme, root=tree) == []


def test_broken_links_are_reported(tree: Path):
    page = tree / "docs" / "other.md"
    page.write_text(
        "# Other\n\n[gone](missing.md) and [bad anchor](page.md#no-such-heading)\n"
        "[self](#nowhere), [out](../../outside.md), [anchor into a file](../deploy/Dockerfile#x)\n"
        "`[in code](missing-too.md)`\n\n```\n[in a fence](missing-three.md)\n```\n"
    )
    got = check_file(page, root=tree)
    assert got == [
        "docs/other.md:3: missing.md: no such file",
        "docs/other.md:3: page.md#no-such-heading: no heading #no-such-heading in page.md",
        "docs/other.md:4: #nowhere: no heading #nowhere in other.md",
        "docs/other.md:4: ../../outside.md: points outside the repository",
        "docs/other.md:4: ../deploy/Dockerfile#x: an anchor into something that is not a markdown file",
    ]


def test_main_exit_status(tree: Path, capsys):
    good, bad = tree / "good.md", tree / "bad.md"
    good.write_text("[page](docs/page.md)\n")
    bad.write_text("[page](docs/nope.md)\n")
    assert check_links.main([str(good)], root=tree) == 0
    assert check_links.main([str(good), str(bad)], root=tree) == 1
    assert "docs/nope.md: no such file" in capsys.readouterr().out


def test_the_project_markdown_has_no_broken_link():
    files = check_links.default_files()
    names = {str(f.relative_to(check_links.ROOT)) for f in files}
    assert {"README.md", "docs/concepts.md", "deploy/README.md", "BENCHMARKS.md"} <= names
    assert [p for f in files for p in check_links.check_file(f)] == []
