"""Run untrusted, model-written Python in a bubblewrap sandbox.

Each call of `run_python` starts a fresh sandbox and throws it away afterwards:

* namespaces: new pid, ipc, uts, net (loopback only: nothing outside can be reached) and, where the
  kernel allows, cgroup namespaces; `--die-with-parent` and `--new-session`;
* filesystem: an empty tmpfs root with read-only binds of `/usr` (and the `/bin`, `/lib*`
  symlinks or folders as the host has them), of the interpreter's prefixes (`sys.base_prefix`,
  `sys.prefix` of the venv) and of `/etc/ld.so.cache`; a private `/proc` and a minimal `/dev`;
  `/tmp` is a fresh tmpfs of `workdir_bytes` (every file the run may write, the work folder
  `/tmp/work` included), so that nothing the code writes reaches the host's disk, outlives the run
  or passes that size; `/dev` is bwrap's minimal one, not writable by the code. The host's home
  folder is not bound: only the interpreter's own prefix below it, and the folders leading there
  are created mode 0711 (traversable, not listable);
* identity and limits: the code runs as uid/gid 65534 (`nobody`) with no capabilities, no
  supplementary groups and `no_new_privs` (`setpriv`); rlimits (address space, CPU seconds, file
  size, open files, processes, no core dumps) are set by `prlimit` right before the interpreter
  starts. RLIMIT_NPROC counts every process of that uid on the host, so concurrent sandboxes share
  it (a fork bomb in one can make `fork` fail in another while it lasts); give concurrent
  sandboxes distinct `uid`s where that matters;
* the run as a whole: a cgroup of its own (`runtime.sandbox.cgroup`) caps the memory of all its
  processes together with the files they wrote (`total_memory_bytes`) and the count of its
  processes (`max_processes`); a run the kernel killed for that limit ends with
  "sandbox_memory_limit". Where no cgroup can be made, the process cap is lowered to
  `total_memory_bytes // memory_bytes` so that RLIMIT_AS times it stays within the same total;
* a wall-clock limit enforced from the outside: the sandbox runs in its own process group, which
  is killed on the deadline; killing bwrap tears down the pid namespace and with it every process
  inside;
* stdout and stderr are read as they come and kept up to `max_output_bytes` each (the rest is
  drained and counted, and the text says it was truncated).

The host side needs root (bwrap creates the namespaces with real privileges and `setpriv` drops
them); `SandboxUnavailable` says what is missing when that does not hold.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from runtime.sandbox import cgroup as sandbox_cgroup
from runtime.sandbox.cgroup import RunGroup

log = logging.getLogger("spopp.sandbox")

KiB = 1024
MiB = 1024 * KiB

#: Where the work folder (a tmpfs) lies inside the sandbox; the code runs there as main.py.
WORKDIR = "/tmp/work"
SCRIPT_NAME = "main.py"

INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: `apt-get install bubblewrap`; Fedora/RHEL: "
    "`dnf install bubblewrap`) and util-linux (`setpriv`, `prlimit`), and run the rollout service "
    "as root inside its container (bwrap must be able to create pid, net, ipc and uts namespaces)"
)


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run here (bwrap missing, or it cannot create namespaces)."""


@dataclass(frozen=True)
class SandboxConfig:
    wall_seconds: float = 5.0
    cpu_seconds: int = 5
    memory_bytes: int = 512 * MiB  # RLIMIT_AS, each process
    total_memory_bytes: int = 1024 * MiB  # every process and file of the run together (a cgroup)
    file_bytes: int = 1 * MiB  # RLIMIT_FSIZE: the largest file the code may write
    max_processes: int = 16  # the run's processes (its pids cgroup); also RLIMIT_NPROC, per uid
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_output_bytes: int = 8 * KiB  # kept of stdout and of stderr, each
    workdir_bytes: int = 256 * MiB  # size of /tmp's tmpfs: all the files of a run (host memory, freed after)
    cgroups: bool = True  # False: rlimits alone (the fallback where no cgroup can be made)
    python: str = sys.executable
    bwrap_path: str = "bwrap"
    uid: int = 65534
    gid: int = 65534


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # the interpreter's exit status; 128+N when signal N ended it
    timed_out: bool  # the wall-clock or the CPU-time limit ended the run
    # Why the run ended abnormally, when a limit or a signal did it: "wall_timeout", "cpu_limit",
    # "memory_limit" (one process's RLIMIT_AS), "sandbox_memory_limit" (the run's cgroup),
    # "file_size_limit", "process_limit", "open_files_limit", "workdir_full" (/tmp's tmpfs),
    # "signal:SIGSEGV", ... The ones read off a traceback need the exception to end the script.
    killed_reason: str | None
    duration_s: float
    output_truncated: bool = False

    @property
    def failed(self) -> bool:
        """Non-zero exit, a timeout or a kill."""
        return self.timed_out or self.killed_reason is not None or self.exit_code != 0


@dataclass(frozen=True)
class _Setup:
    bwrap: str
    setpriv: str
    prlimit: str
    python: str
    # (host path, sandbox path) of the interpreter's prefixes to bind read-only
    prefix_binds: tuple[tuple[str, str], ...]


_setup_cache: dict[tuple[str, str], _Setup | SandboxUnavailable] = {}
_setup_lock = threading.Lock()

# Top-level system folders bound read-only (or recreated as the symlinks they are on the host).
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# Single harmless files from /etc: the dynamic loader's cache, the time zone.
_ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime")


def _resolve_exe(path: str) -> str | None:
    if os.sep in path:
        return path if os.path.isfile(path) and os.access(path, os.X_OK) else None
    return shutil.which(path)


def _under(path: str, roots) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _interpreter_prefixes(python: str) -> tuple[tuple[str, str], ...]:
    """Ask the (trusted) interpreter on the host where it lives, and what to bind for it."""
    probe = "import json, os, sys; print(json.dumps([sys.prefix, sys.base_prefix]))"
    try:
        out = subprocess.run(
            [python, "-I", "-c", probe], capture_output=True, text=True, timeout=30, check=True
        ).stdout
        prefixes = json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        raise SandboxUnavailable(f"cannot run the sandbox's interpreter {python!r} on the host: {e}") from e
    python_dir = os.path.dirname(os.path.abspath(python))
    binds: list[tuple[str, str]] = []
    system = [d for d in _SYSTEM_DIRS if os.path.isdir(d)]
    for p in [*prefixes, python_dir]:
        p = os.path.abspath(p)
        real = os.path.realpath(p)
        for host, inside in ((real, real), (real, p)):
            if _under(inside, system) or _under(inside, [b[1] for b in binds]):
                continue
            binds.append((host, inside))
    return tuple(binds)


_NAMESPACE_FLAGS = (
    "--unshare-ipc",
    "--unshare-pid",
    "--unshare-net",
    "--unshare-uts",
    "--unshare-cgroup-try",
    "--die-with-parent",
    "--new-session",
    "--hostname",
    "sandbox",
)


class _MountPlan:
    """The bwrap filesystem arguments, with the folders made so far (to create parents once)."""

    def __init__(self, argv: list[str]):
        self.argv = argv
        self.made: set[str] = {"/"}

    def parents(self, path: str) -> None:
        # bwrap creates missing parents 0700 (unusable for uid 65534): make them 0711 ourselves.
        head = os.path.dirname(path)
        chain = []
        while head not in self.made and head != "/":
            chain.append(head)
            head = os.path.dirname(head)
        for d in reversed(chain):
            self.argv.extend(["--perms", "0711", "--dir", d])
            self.made.add(d)


def _filesystem_args(argv: list[str], setup: _Setup, config: SandboxConfig, code_fd: int) -> None:
    """Append the mounts: system folders, /etc files, /proc, /dev, /tmp, prefixes, the work folder."""
    for d in _SYSTEM_DIRS:
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    plan = _MountPlan(argv)
    for f in _ETC_FILES:
        if os.path.exists(f):
            plan.parents(f)
            argv += ["--ro-bind", f, f]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    # /tmp first, so that binds below it (a prefix under /tmp, the work folder) land on it. One
    # tmpfs for every file the run writes: the work folder is a folder in it, not a second tmpfs,
    # so that /tmp outside the work folder is no way around the size.
    argv += ["--perms", "1777", "--size", str(config.workdir_bytes), "--tmpfs", "/tmp"]
    plan.made.add("/tmp")
    for host, inside in setup.prefix_binds:
        plan.parents(inside)
        argv += ["--ro-bind", host, inside]
        plan.made.add(inside)
    argv += ["--perms", "0777", "--dir", WORKDIR]
    argv += ["--perms", "0644", "--file", str(code_fd), f"{WORKDIR}/{SCRIPT_NAME}"]


def _environment_args(setup: _Setup) -> list[str]:
    """A cleared environment with only what the interpreter needs, and the work folder as cwd."""
    env = {
        "PATH": os.pathsep.join([os.path.dirname(setup.python), "/usr/local/bin", "/usr/bin", "/bin"]),
        "HOME": WORKDIR,
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
        # The model's code prints sets and dicts of strings in hash order: fixed, not salted per
        # process, so that one program answers alike in every episode and every run.
        "PYTHONHASHSEED": "0",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "MPLBACKEND": "Agg",
    }
    argv = ["--clearenv"]
    for k, v in env.items():
        argv += ["--setenv", k, v]
    argv += ["--chdir", WORKDIR]
    return argv


def process_cap(config: SandboxConfig, grouped: bool) -> int:
    """RLIMIT_NPROC: `max_processes` under a cgroup (which bounds the run's memory as a whole);
    without one, few enough that RLIMIT_AS times the count stays within `total_memory_bytes`."""
    if grouped:
        return config.max_processes
    return max(1, min(config.max_processes, config.total_memory_bytes // config.memory_bytes))


def _command_args(setup: _Setup, config: SandboxConfig, grouped: bool) -> list[str]:
    """The command inside: drop to the unprivileged uid (setpriv), set rlimits (prlimit), run."""
    return [
        setup.setpriv,
        f"--reuid={config.uid}",
        f"--regid={config.gid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
        "--",
        setup.prlimit,
        f"--as={config.memory_bytes}",
        f"--cpu={config.cpu_seconds}:{config.cpu_seconds + 1}",  # SIGXCPU, then SIGKILL a second later
        f"--fsize={config.file_bytes}",
        f"--nofile={config.max_open_files}",
        f"--nproc={process_cap(config, grouped)}",
        "--core=0",
        "--",
        setup.python,
        "-u",
        "-B",
        SCRIPT_NAME,
    ]


# Joins the run's cgroups before bwrap starts (the shell writes its own pid, then becomes bwrap), so
# that nothing of the run is ever outside them: `sh -c JOIN sh N FILE... BWRAP ARGS...`.
_JOIN_FAILED = "spopp-sandbox: cannot join the run's cgroup"
_JOIN = (
    f'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || {{ echo "{_JOIN_FAILED}" >&2; exit 125; }}; '
    'shift; n=$((n-1)); done; exec "$@"'
)


def _build_argv(setup: _Setup, config: SandboxConfig, code_fd: int, group: RunGroup | None) -> list[str]:
    """The full command line: join the run's cgroups, then bwrap (namespaces, mounts, environment,
    the limited interpreter)."""
    argv = [setup.bwrap, *_NAMESPACE_FLAGS]
    _filesystem_args(argv, setup, config, code_fd)
    argv += _environment_args(setup)
    argv += _command_args(setup, config, group is not None)
    if group is not None:
        argv = ["/bin/sh", "-c", _JOIN, "sh", str(len(group.procs_files)), *group.procs_files, *argv]
    return argv


def _get_setup(config: SandboxConfig) -> _Setup:
    """Find the tools and check once (per bwrap and interpreter) that a sandbox really starts."""
    key = (config.bwrap_path, config.python)
    with _setup_lock:
        cached = _setup_cache.get(key)
        if cached is None:
            try:
                cached = _check_setup(config)
            except SandboxUnavailable as e:
                cached = e
            _setup_cache[key] = cached
    if isinstance(cached, SandboxUnavailable):
        raise SandboxUnavailable(str(cached))
    return cached


def _check_setup(config: SandboxConfig) -> _Setup:
    bwrap = _resolve_exe(config.bwrap_path)
    if bwrap is None:
        raise SandboxUnavailable(f"bubblewrap not found (bwrap_path={config.bwrap_path!r}): {INSTALL_HINT}")
    tools = {}
    for tool in ("setpriv", "prlimit"):
        found = shutil.which(tool)
        if found is None:
            raise SandboxUnavailable(f"`{tool}` not found: {INSTALL_HINT}")
        tools[tool] = os.path.realpath(found)
    python = os.path.abspath(config.python)
    setup = _Setup(bwrap, tools["setpriv"], tools["prlimit"], python, _interpreter_prefixes(python))
    probe_config = SandboxConfig(python=python, bwrap_path=config.bwrap_path, wall_seconds=30)
    try:
        res = _run(setup, probe_config, "print('sandbox-ok')\n")
    except OSError as e:
        raise SandboxUnavailable(f"cannot start bwrap ({bwrap}): {e}; {INSTALL_HINT}") from e
    if res.exit_code != 0 or res.stdout.strip() != "sandbox-ok":
        raise SandboxUnavailable(
            f"bwrap ({bwrap}) could not start a sandbox (exit {res.exit_code}): "
            f"{(res.stderr or res.stdout).strip()[:500]!r}; {INSTALL_HINT}"
        )
    return setup


def run_python(code: str, config: SandboxConfig | None = None) -> SandboxResult:
    """Run `code` as a script in a fresh sandbox; never raises for anything the code does."""
    config = config or SandboxConfig()
    setup = _get_setup(config)
    try:
        return _run(setup, config, code)
    except OSError as e:  # bwrap itself could not be started (removed since the check?)
        raise SandboxUnavailable(f"cannot start bwrap ({setup.bwrap}): {e}; {INSTALL_HINT}") from e


class _Stream:
    def __init__(self, cap: int):
        self.cap = cap
        self.data = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        room = self.cap - len(self.data)
        if room > 0:
            self.data += chunk[:room]
        self.dropped += max(0, len(chunk) - max(room, 0))

    def text(self) -> str:
        out = self.data.decode("utf-8", errors="replace")
        if self.dropped:
            out += f"\n[output truncated: {self.dropped} more bytes not shown]"
        return out


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # start_new_session: the group id is bwrap's pid
    except (ProcessLookupError, PermissionError):
        pass


def _start(setup: _Setup, config: SandboxConfig, code: str, group: RunGroup | None) -> subprocess.Popen:
    """Start bwrap in its own session, the code passed as an anonymous file (closed here after)."""
    with tempfile.TemporaryFile() as code_file:
        code_file.write(code.encode("utf-8", errors="surrogatepass"))
        code_file.flush()
        code_file.seek(0)
        return subprocess.Popen(
            _build_argv(setup, config, code_file.fileno(), group),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(code_file.fileno(),),
            start_new_session=True,
            cwd="/",
            env={"PATH": "/usr/bin:/bin"},
        )


class _Pump:
    """Reads the sandbox's stdout and stderr without blocking, into capped streams."""

    def __init__(self, proc: subprocess.Popen, out_stream: _Stream, err_stream: _Stream):
        self.sel = selectors.DefaultSelector()
        self.streams = {proc.stdout.fileno(): out_stream, proc.stderr.fileno(): err_stream}
        for f in (proc.stdout, proc.stderr):
            os.set_blocking(f.fileno(), False)
            self.sel.register(f, selectors.EVENT_READ)

    def __call__(self, until: float) -> bool:
        """Read until both pipes close (True) or the time `until` passes (False)."""
        while self.sel.get_map():
            remaining = until - time.monotonic()
            if remaining <= 0:
                return False
            for key, _ in self.sel.select(remaining):
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if chunk:
                    self.streams[key.fd].add(chunk)
                else:
                    self.sel.unregister(key.fileobj)
        return True


def _wait_for(proc: subprocess.Popen, out_stream: _Stream, err_stream: _Stream, deadline: float) -> bool:
    """Collect the output until the process ends; kill it at the deadline. True if it timed out."""
    pump = _Pump(proc, out_stream, err_stream)
    timed_out_wall = False
    if pump(deadline):
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out_wall = True
    else:
        timed_out_wall = True
    if timed_out_wall:
        _kill_group(proc)
        proc.wait()
        pump(time.monotonic() + 1.0)  # the pid namespace dies with bwrap: pipes close at once
    pump.sel.close()
    return timed_out_wall


def _run_group(config: SandboxConfig) -> RunGroup | None:
    """The run's own cgroup, or None where none can be made (the rlimits' fallback: for this run
    alone when a group that could be made before cannot now, e.g. the kernel out of cgroup ids)."""
    if not config.cgroups:
        return None
    hierarchies = sandbox_cgroup.detect()
    if isinstance(hierarchies, str):
        return None
    try:
        return RunGroup(hierarchies, config.total_memory_bytes, config.max_processes)
    except OSError as e:
        log.warning("sandbox: no cgroup for this run (%s): rlimits alone", e)
        return None


def _run(setup: _Setup, config: SandboxConfig, code: str) -> SandboxResult:
    started = time.monotonic()
    deadline = started + config.wall_seconds
    out_stream, err_stream = _Stream(config.max_output_bytes), _Stream(config.max_output_bytes)
    group = _run_group(config)
    try:
        proc = _start(setup, config, code, group)
        try:
            timed_out_wall = _wait_for(proc, out_stream, err_stream, deadline)
        finally:
            if proc.poll() is None:
                _kill_group(proc)
                proc.wait()
            for f in (proc.stdout, proc.stderr):
                f.close()
        oom = group is not None and group.oom_killed()
    finally:
        if group is not None:
            group.remove()
    duration = time.monotonic() - started
    exit_code = None if timed_out_wall else proc.returncode
    stderr = err_stream.text()
    if oom:  # whatever else it looks like, the run's memory as a whole ran out
        reason = "sandbox_memory_limit"
    else:
        reason = "wall_timeout" if timed_out_wall else _killed_reason(exit_code, err_stream.data)
    return SandboxResult(
        stdout=out_stream.text(),
        stderr=stderr,
        exit_code=exit_code,
        timed_out=reason in ("wall_timeout", "cpu_limit"),
        killed_reason=reason,
        duration_s=duration,
        output_truncated=bool(out_stream.dropped or err_stream.dropped),
    )


def _killed_reason(exit_code: int | None, stderr: bytes) -> str | None:
    if exit_code is None or exit_code == 0:
        return None
    if exit_code == 125 and _JOIN_FAILED.encode() in stderr:
        return "sandbox_setup_failed"  # the code never ran
    if exit_code > 128:
        sig = exit_code - 128
        if sig == signal.SIGXCPU:
            return "cpu_limit"
        if sig == signal.SIGXFSZ:
            return "file_size_limit"
        try:
            return f"signal:{signal.Signals(sig).name}"
        except ValueError:
            pass
    # Limits that surface as Python exceptions: look at the traceback's last lines.
    tail = stderr[-2048:].decode("utf-8", errors="replace")
    last = tail.strip().splitlines()[-1] if tail.strip() else ""
    if last.startswith("MemoryError") or "Cannot allocate memory" in tail:
        return "memory_limit"
    if "[Errno 27]" in last or "File too large" in last:
        return "file_size_limit"
    if "[Errno 28]" in last or "No space left on device" in last:
        return "workdir_full"
    if "[Errno 24]" in last or "Too many open files" in last:
        return "open_files_limit"
    if "[Errno 11]" in last and ("fork" in tail or "Resource temporarily unavailable" in last):
        return "process_limit"
    return None


def check_sandbox(config: SandboxConfig | None = None) -> None:
    """Raise SandboxUnavailable now, at start-up, rather than in the first episode."""
    _get_setup(config or SandboxConfig())


def bounds(config: SandboxConfig | None = None) -> str:
    """One line on how a run's memory and processes are bounded here (cgroup or rlimits alone),
    for a service's start-up log."""
    config = config or SandboxConfig()
    found = sandbox_cgroup.detect() if config.cgroups else "cgroups turned off"
    mib = 2**20
    if isinstance(found, str):
        return (
            f"sandbox: no cgroup ({found}); each run's memory bounded by rlimits alone: "
            f"{process_cap(config, False)} processes x {config.memory_bytes // mib} MiB, "
            f"files {config.workdir_bytes // mib} MiB"
        )
    kinds = ", ".join(f"v{h.version} {h.controller}" for h in found)
    return (
        f"sandbox: each run in its own cgroup ({kinds}): {config.total_memory_bytes // mib} MiB of memory "
        f"and files together, {config.max_processes} processes, files {config.workdir_bytes // mib} MiB"
    )
