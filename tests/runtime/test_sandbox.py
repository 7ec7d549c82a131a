"""The bubblewrap sandbox against real hostile code (needs bwrap and root, as the rollout service)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from runtime.sandbox.bubblewrap import SandboxConfig, SandboxUnavailable, run_python

pytestmark = pytest.mark.process  # starts processes: the process tier (tests/conftest.py)

FAST = SandboxConfig(wall_seconds=5, cpu_seconds=3)


def _uid_processes(uid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    pids.append(int(entry))
            except FileNotFoundError:
                pass
    return pids


def test_normal_script_returns_output_quickly():
    code = "import sys\nprint(sum(range(10)))\nprint('to stderr', file=sys.stderr)\n"
    t0 = time.monotonic()
    res = run_python(code, FAST)
    elapsed = time.monotonic() - t0
    assert res.stdout == "45\n"
    assert res.stderr == "to stderr\n"
    assert res.exit_code == 0 and not res.failed
    assert res.killed_reason is None and not res.timed_out and not res.output_truncated
    assert elapsed < 2.0 and res.duration_s < 2.0


def test_hash_order_is_the_same_in_every_run():
    """Strings hash unsalted (PYTHONHASHSEED=0): a set prints in one order in every episode."""
    code = "import os\nprint(os.environ['PYTHONHASHSEED'], {f'w{i}' for i in range(12)})\n"
    first = run_python(code, FAST)
    assert first.exit_code == 0, first.stderr
    assert first.stdout.startswith("0 {") and run_python(code, FAST).stdout == first.stdout


def test_runs_as_nobody_without_capabilities_or_host_environment(monkeypatch):
    monkeypatch.setenv("SPOPP_SANDBOX_SECRET_ENV", "leaked")
    code = (
        "import os\n"
        "print(os.getuid(), os.getgid(), os.getgroups())\n"
        "caps = dict(l.split(':\\t') for l in open('/proc/self/status').read().splitlines() if l.startswith('Cap'))\n"
        "print(int(caps['CapEff'], 16), int(caps['CapBnd'], 16))\n"
        "print(sorted(os.environ))\n"
    )
    res = run_python(code, FAST)
    assert res.exit_code == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "65534 65534 []"
    assert lines[1] == "0 0"
    assert "SPOPP_SANDBOX_SECRET_ENV" not in lines[2]
    assert "leaked" not in res.stdout


def test_nonzero_exit_and_traceback_are_reported():
    res = run_python("raise ValueError('boom')\n", FAST)
    assert res.exit_code == 1 and res.failed
    assert "ValueError: boom" in res.stderr
    assert res.killed_reason is None


def test_infinite_loop_is_stopped_by_the_cpu_limit():
    t0 = time.monotonic()
    res = run_python("while True:\n    pass\n", SandboxConfig(wall_seconds=8, cpu_seconds=1))
    assert time.monotonic() - t0 < 4.0
    assert res.timed_out and res.failed
    assert res.killed_reason == "cpu_limit"


def test_infinite_loop_is_stopped_by_the_wall_limit():
    t0 = time.monotonic()
    res = run_python("while True:\n    pass\n", SandboxConfig(wall_seconds=1.0, cpu_seconds=30))
    assert time.monotonic() - t0 < 2.0
    assert res.timed_out and res.killed_reason == "wall_timeout"
    assert res.exit_code is None


def test_sleep_is_killed_on_the_wall_clock():
    config = SandboxConfig(wall_seconds=1.5, cpu_seconds=5)
    t0 = time.monotonic()
    res = run_python("import time\nprint('before', flush=True)\ntime.sleep(100)\nprint('after')\n", config)
    elapsed = time.monotonic() - t0
    assert elapsed < config.wall_seconds + 1.0
    assert res.timed_out and res.killed_reason == "wall_timeout"
    assert res.stdout == "before\n"  # what came before the kill is kept


def test_huge_allocation_fails_and_is_reported():
    code = "x = bytearray(2 * 1024**3)\nprint('allocated', len(x))\n"
    res = run_python(code, FAST)
    assert "allocated" not in res.stdout
    assert res.failed
    assert res.killed_reason == "memory_limit"
    assert "MemoryError" in res.stderr


def test_fork_bomb_is_contained():
    baseline = len(_uid_processes(65534))
    code = (
        "import os, time\n"
        "n, err = 0, None\n"
        "for _ in range(200):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError as e:\n"
        "        err = e\n"
        "        break\n"
        "    if pid == 0:\n"
        "        while True:\n"
        "            try:\n"
        "                os.fork()\n"
        "            except OSError:\n"
        "                time.sleep(0.01)\n"
        "    n += 1\n"
        "print('forked', n, type(err).__name__, flush=True)\n"
        "time.sleep(100)\n"
    )
    config = SandboxConfig(wall_seconds=2.5, cpu_seconds=5, max_processes=8)
    t0 = time.monotonic()
    res = run_python(code, config)
    assert time.monotonic() - t0 < config.wall_seconds + 1.5
    assert res.timed_out and res.killed_reason == "wall_timeout"
    forked = res.stdout.split()
    assert forked[0] == "forked" and forked[2] == "BlockingIOError", res.stdout + res.stderr
    assert int(forked[1]) < config.max_processes
    # Everything of the bomb is gone, and the host still forks.
    deadline = time.monotonic() + 3.0
    while len(_uid_processes(65534)) > baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_uid_processes(65534)) <= baseline
    assert subprocess.run(["true"], check=False).returncode == 0
    assert run_python("print('alive')", FAST).stdout == "alive\n"


def test_network_is_unreachable():
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        code = (
            "import socket\n"
            f"for addr in [('127.0.0.1', {port}), ('1.1.1.1', 53)]:\n"
            "    try:\n"
            "        socket.create_connection(addr, timeout=2).close()\n"
            "        print(addr[0], 'connected')\n"
            "    except OSError as e:\n"
            "        print(addr[0], 'failed', type(e).__name__)\n"
        )
        res = run_python(code, FAST)
        assert res.exit_code == 0, res.stderr
        lines = res.stdout.splitlines()
        assert len(lines) == 2
        assert all(" failed " in line for line in lines), res.stdout
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing reached the host's listener
    finally:
        listener.close()


def test_writes_outside_the_work_dir_fail():
    name = f"spopp_sandbox_escape_{uuid.uuid4().hex[:8]}"
    targets = [
        f"/usr/{name}",
        f"/etc/{name}",
        f"/root/{name}",
        f"/{name}",
        f"/usr/lib/{name}",
        os.path.join(os.path.realpath(sys.base_prefix), name),
        os.path.join(sys.prefix, name),
    ]
    code = (
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print(path, 'WROTE')\n"
        "    except OSError as e:\n"
        "        print(path, 'failed', type(e).__name__)\n"
        # /tmp is the sandbox's own tmpfs: writable inside, never the host's /tmp
        f"open('/tmp/{name}', 'w').write('x')\n"
    )
    res = run_python(code, FAST)
    assert res.exit_code == 0, res.stderr
    assert "WROTE" not in res.stdout
    assert res.stdout.count(" failed ") == len(targets)
    for path in [*targets, f"/tmp/{name}"]:
        assert not os.path.exists(path)


def test_host_home_folder_is_not_readable():
    secret = uuid.uuid4().hex
    probe = Path("/root/.spopp_sandbox_probe")
    probe.write_text(secret)
    try:
        code = (
            "import os\n"
            "for path in ['/root', '/work/main', '/work/main/services']:\n"
            "    try:\n"
            "        print(path, 'LISTED', os.listdir(path))\n"
            "    except OSError as e:\n"
            "        print(path, 'list failed', type(e).__name__)\n"
            "try:\n"
            "    print('READ', open('/root/.spopp_sandbox_probe').read())\n"
            "except OSError as e:\n"
            "    print('read failed', type(e).__name__)\n"
        )
        res = run_python(code, FAST)
        assert res.exit_code == 0, res.stderr
        assert secret not in res.stdout
        assert "READ" not in res.stdout and "read failed" in res.stdout
        assert "/root list failed" in res.stdout
        assert "services" not in res.stdout.replace("/work/main/services", "")
        # Not merely unreadable for uid 65534: not there. As uid 0 inside (the owner of the host's
        # /root, though without capabilities) the file is still absent.
        as_root = run_python(code, SandboxConfig(wall_seconds=5, uid=0, gid=0))
        assert as_root.exit_code == 0, as_root.stderr
        assert secret not in as_root.stdout and "read failed FileNotFoundError" in as_root.stdout
        assert ".spopp_sandbox_probe" not in as_root.stdout
    finally:
        probe.unlink()


def test_work_dir_is_writable_private_and_discarded():
    marker = f"spopp_workfile_{uuid.uuid4().hex[:8]}.txt"
    code = (
        "import os\n"
        f"open({marker!r}, 'w').write('kept')\n"
        f"print(os.getcwd(), open({marker!r}).read(), {marker!r} in os.listdir('.'))\n"
    )
    res = run_python(code, FAST)
    assert res.exit_code == 0, res.stderr
    assert res.stdout.split() == ["/tmp/work", "kept", "True"]
    again = run_python(f"import os\nprint(os.path.exists({marker!r}))\n", FAST)
    assert again.stdout == "False\n"
    # Nothing of the run landed on the host's disk.
    assert not list(Path("/tmp").glob(f"*/{marker}")) and not Path("/tmp", marker).exists()


def test_file_size_limit():
    code = "open('big.bin', 'wb').write(b'x' * (2 * 1024 * 1024))\n"
    res = run_python(code, SandboxConfig(wall_seconds=5, file_bytes=1024 * 1024))
    assert res.failed and res.killed_reason == "file_size_limit", res.stderr


def test_large_output_is_truncated_and_says_so():
    config = SandboxConfig(wall_seconds=5, max_output_bytes=1000)
    res = run_python("import sys\nprint('x' * 100_000)\nsys.stderr.write('e' * 50_000)\n", config)
    assert res.exit_code == 0
    assert res.output_truncated
    assert res.stdout.startswith("x" * 1000)
    assert res.stdout.count("x") == 1000
    assert "truncated" in res.stdout and "99001 more bytes" in res.stdout
    assert res.stderr.startswith("e" * 1000) and not res.stderr.startswith("e" * 1001)
    assert "truncated" in res.stderr and "49000 more bytes" in res.stderr


def test_missing_bwrap_raises_sandbox_unavailable():
    with pytest.raises(SandboxUnavailable, match="bubblewrap"):
        run_python("print(1)", SandboxConfig(bwrap_path="/nonexistent/bwrap"))
    # checked once and cached: the second call says the same
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        run_python("print(1)", SandboxConfig(bwrap_path="/nonexistent/bwrap"))


def test_concurrent_runs_from_threads_stay_apart():
    from concurrent.futures import ThreadPoolExecutor

    code = "import os, time\nopen('mine.txt', 'w').write('{i}')\ntime.sleep(0.3)\nprint(open('mine.txt').read())\n"
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: run_python(code.replace("{i}", str(i)), FAST), range(4)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(4)]


# ---- the run bounded as a whole (issue 48, finding 2) -------------------------------------------

MiB = 1024 * 1024


def test_files_anywhere_in_tmp_count_against_one_small_tmpfs():
    """/tmp outside the work folder was a tmpfs of half the host's RAM: 2,111 MiB written in one
    episode. Now every file of a run shares `workdir_bytes`; the 17th MiB fails with ENOSPC."""
    code = (
        "import os\n"
        "total = 0\n"
        "for name in ('/tmp', '/tmp/work'):\n"
        "    for i in range(48):\n"
        "        try:\n"
        "            with open(f'{name}/f{i}', 'wb') as f:\n"
        "                f.write(b'x' * (1 << 20))\n"
        "        except OSError as e:\n"
        "            print('stopped', name, e.errno, flush=True)\n"
        "            break\n"
        "        total += 1 << 20\n"
        "print('total', total, flush=True)\n"
        "open('/tmp/work/last', 'wb').write(b'x' * (1 << 20))\n"
    )
    config = SandboxConfig(wall_seconds=10, cpu_seconds=5, file_bytes=2 * MiB, workdir_bytes=16 * MiB)
    res = run_python(code, config)
    lines = res.stdout.split("\n")
    # ENOSPC (28) below /tmp, outside the work folder
    assert lines[0] == "stopped /tmp 28", res.stdout + res.stderr
    total = int(next(line for line in lines if line.startswith("total")).split()[1])
    assert total <= 16 * MiB  # /tmp and the work folder together: one budget
    assert res.killed_reason == "workdir_full"


_FORK_HOLDERS = (
    "import os, sys, time\n"
    "def hold(n):\n"
    "    b = bytearray(n)\n"
    "    b[::4096] = b'\\x01' * len(range(0, n, 4096))  # touch every page: resident, not just mapped\n"
    "    print('held', os.getpid(), flush=True)\n"
    "    time.sleep(3)\n"
    "    os._exit(0)\n"
    "kids = []\n"
    "for _ in range(4):\n"
    "    try:\n"
    "        pid = os.fork()\n"
    "    except OSError as e:\n"
    "        print('fork failed', e.errno, flush=True)\n"
    "        break\n"
    "    if pid == 0:\n"
    "        hold(200 << 20)\n"
    "    kids.append(pid)\n"
    "codes = [os.waitpid(k, 0)[1] for k in kids]\n"
    "print('children', len(kids), 'killed', sum(c != 0 for c in codes), flush=True)\n"
)


def test_forked_children_share_one_memory_bound():
    """RLIMIT_AS is per process: 8 children of 400 MiB were all resident at once (3.1 GiB). In the
    run's cgroup, 4 children of 200 MiB under a 512 MiB bound cannot all hold their memory: the
    kernel kills within the run, and the run says which limit."""
    from runtime.sandbox import cgroup as sandbox_cgroup

    assert not isinstance(sandbox_cgroup.detect(), str), sandbox_cgroup.detect()  # root, as the replica
    config = SandboxConfig(
        wall_seconds=15, cpu_seconds=10, memory_bytes=400 * MiB, total_memory_bytes=512 * MiB
    )
    res = run_python(_FORK_HOLDERS, config)
    assert res.killed_reason == "sandbox_memory_limit", res.stdout + res.stderr
    # 4 x 200 MiB plus four interpreters cannot fit in 512 MiB: at least one child was killed (or
    # the parent with them; then its last line never comes).
    last = res.stdout.strip().splitlines()[-1]
    if last.startswith("children"):
        assert int(last.split()[3]) >= 1, res.stdout
    assert res.stdout.count("held") <= 4


def test_without_a_cgroup_the_process_cap_keeps_the_total():
    """The fallback (no writable cgroup, e.g. a container's read-only /sys/fs/cgroup): RLIMIT_AS of
    256 MiB times a cap of 512 // 256 = 2 processes: the first child forks, the second cannot."""
    from runtime.sandbox.bubblewrap import process_cap

    config = SandboxConfig(
        wall_seconds=15, cpu_seconds=10, memory_bytes=256 * MiB, total_memory_bytes=512 * MiB, cgroups=False
    )
    assert process_cap(config, grouped=False) == 2
    res = run_python(_FORK_HOLDERS, config)
    # RLIMIT_NPROC counts the uid's processes on the host: other runs of uid 65534 at the same time
    # only lower what this run may fork, so "at most one child" holds whatever runs beside it.
    assert "fork failed 11" in res.stdout, res.stdout + res.stderr
    assert res.stdout.count("held") <= 1


def test_run_groups_are_removed_after_each_run_and_swept_after_a_dead_owner():
    from runtime.sandbox import cgroup as sandbox_cgroup

    hierarchies = sandbox_cgroup.detect()
    assert not isinstance(hierarchies, str), hierarchies
    mine = f"{sandbox_cgroup.PREFIX}{os.getpid()}-"
    for res in (
        run_python("print(1)", FAST),
        run_python("import time\ntime.sleep(30)", SandboxConfig(wall_seconds=1)),
    ):
        assert res.stdout == "1\n" or res.killed_reason == "wall_timeout"
    for h in hierarchies:
        assert not [d for d in h.parent.iterdir() if d.name.startswith(mine)]
    # A group left by a process that died (SIGKILLed mid-run) is swept by the next process's start.
    stale_pid = 2**22 + 12345  # above pid_max's default: never a live process
    stale = [h.parent / f"{sandbox_cgroup.PREFIX}{stale_pid}-0" for h in hierarchies]
    for d in stale:
        d.mkdir()
    sandbox_cgroup._sweep(hierarchies)
    assert not any(d.exists() for d in stale)
