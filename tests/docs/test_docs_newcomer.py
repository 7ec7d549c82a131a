"""The newcomer's page runs as written: docs/environments.md "From nothing to a run" is extracted
and run by bash, literally, in an empty temporary folder, with nothing but the installed `spopp`
on PATH (no settings from this machine's environment). The page's promise is what it shows: a
model made, a package checked (`the contract holds`), a run launched to its end."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from spopp.settings.base import environ_without_settings

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "environments.md"

pytestmark = pytest.mark.process


def block_under(heading: str, page: Path = PAGE) -> str:
    """The first ```bash block of the section `heading`."""
    text = page.read_text()
    section = text[text.index(f"## {heading}\n") :]
    found = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert found, f"no bash block under {heading!r}"
    return found.group(1)


def test_the_block_makes_its_own_model_and_yaml():
    """Nothing the block uses comes from outside it (the old page named runs/demo/model, which
    nothing made, and a yaml it never showed)."""
    block = block_under("From nothing to a run")
    assert "spopp model tiny models/tiny" in block
    assert "cat > my-run.yaml" in block and "spopp launch my-run.yaml" in block
    assert "runs/demo" not in block


def _end_tree(pid: int) -> None:
    """SIGKILL the block's shell and everything under it (the launch and its services)."""
    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=30)


# A tiny model, a check of 8 episodes and a 2-update run: about 2 minutes alone, up to 3x that on a
# loaded 2-core machine.
@pytest.mark.timeout(900)
def test_from_nothing_to_a_run_runs_as_written(tmp_path, model_cache_env):
    script = tmp_path / "page.sh"
    script.write_text("set -euo pipefail\n" + block_under("From nothing to a run"))
    # No setting of this machine's but the model cache, which holds the session's tiny model:
    # `spopp model tiny` copies it from there as it would on a machine that had built it before
    # (tests/runtime/test_tiny_model_cache.py tests the first build and the copy alike).
    env = {
        **environ_without_settings(),
        **model_cache_env,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    env.pop("PYTHONPATH", None)
    # Its own session, so that a timeout ends the launch and its services too, not bash alone.
    with subprocess.Popen(
        ["bash", str(script)], cwd=tmp_path, env=env, text=True, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    ) as proc:  # fmt: skip
        try:
            stdout, stderr = proc.communicate(timeout=840)
        except subprocess.TimeoutExpired:
            _end_tree(proc.pid)
            stdout, stderr = proc.communicate()
            pytest.fail(f"the page's block ran past 840 s; its output:\n{(stdout + stderr)[-4000:]}")
    r = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "environment guesspkg.rewards:exact: the contract holds" in r.stdout
    assert "run spopp-s0: finished" in out
    run = tmp_path / "runs" / "spopp-s0"
    assert json.loads((run / "run.json").read_text())["env"] == "guesspkg.rewards:exact"
    assert (run / "api-token").stat().st_mode & 0o777 == 0o600
