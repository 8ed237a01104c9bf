"""Running an interpreter on untrusted code with bounded output and time, and stopping it.

:func:`run_bounded` feeds the code on stdin and reads stdout and stderr (one pipe, in the order
written) up to a bound, without threads: at the bound or the wall-clock deadline it kills the
program (its caller says how: a process group, a PID namespace) and waits until it is gone.
:data:`PRELUDE` is the interpreter's first statements: kernel resource limits, set before the
code runs and impossible to raise again without privileges (unlike an audit hook, which runs in
the code's own interpreter and can be undone). :class:`UnsandboxedProcess` is ``env.python_sandbox=
none``: these limits, and no isolation at all.
"""

from __future__ import annotations

import logging
import math
import os
import select
import selectors
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable

from rlhf_torchrl.envs.sandbox import Execution, SandboxSpec

log = logging.getLogger(__name__)

#: open files per process: bounds the memory a program can hold in pipes and socket buffers (each
#: at most 64 KiB, and about twice ``net.core.wmem_default``: the seccomp filter refuses more)
MAX_OPEN_FILES = 64

# the interpreter's first statements (argv: uid, CPU seconds, address-space bytes, processes,
# file bytes, open files, inodes; -1 leaves a limit alone). In a sandbox (inodes >= 0): limit the
# inodes of its tmpfs mounts (bubblewrap sets their size, not their inode count: 200k empty files
# held 200 MiB of kernel memory), then give up every capability, and stop unless none is left.
# Then drop to ``uid`` where still root (bubblewrap ran as root, without a user namespace, so that
# the kernel counts this uid's processes: RLIMIT_NPROC never holds for root), set the limits and
# run the code from stdin.
PRELUDE = r"""
import os, resource, sys
uid, cpu, memory, processes, file_size, files, inodes = (int(a) for a in sys.argv[1:8])
if inodes >= 0:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    for path, count in ((b"/tmp", inodes), (b"/dev/shm", inodes)):
        if libc.mount(None, path, None, 0x26, b"nr_inodes=%d" % count):  # MS_REMOUNT|NOSUID|NODEV
            sys.exit(f"sandbox: cannot limit the inodes of {path.decode()}: "
                     f"{os.strerror(ctypes.get_errno())}")
if uid >= 0 and os.getuid() == 0:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
if inodes >= 0:
    header, data = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()  # capset v3
    libc.capset(header, data)
    status = open("/proc/self/status").read()
    if any(f"{name}:\t0000000000000000" not in status for name in ("CapEff", "CapPrm", "CapAmb")):
        sys.exit("sandbox: cannot give up its capabilities")
    del ctypes, libc, path, count, header, data, status
for limit, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, memory),
                     (resource.RLIMIT_NPROC, processes), (resource.RLIMIT_FSIZE, file_size),
                     (resource.RLIMIT_NOFILE, files), (resource.RLIMIT_CORE, 0)):
    if value >= 0:
        resource.setrlimit(limit, (value, value))
code = sys.stdin.buffer.read().decode("utf-8", "replace")
sys.argv = [""]
del os, resource, uid, cpu, memory, processes, file_size, files, inodes, limit, value
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
"""


def python_command(python: str, spec: SandboxSpec, timeout: float, *, uid: int = -1,
                   max_processes: int | None = None, inodes: int = -1) -> list[str]:
    """``python`` running :data:`PRELUDE` with ``spec``'s limits: CPU time ``timeout`` (rounded
    up), address space ``spec.memory_mb``, ``max_processes`` (default ``spec.max_processes``; -1:
    no limit), files up to the scratch folder's size, :data:`MAX_OPEN_FILES`. ``-u``: what the
    code printed before a kill comes back; ``-X utf8``: whatever the locale.

    Args:
        python: the interpreter.
        spec: the limits.
        timeout: the CPU-time limit, in seconds.
        uid: the uid :data:`PRELUDE` switches to (-1: stay).
        max_processes: the process limit (None: ``spec.max_processes``; -1: none).
        inodes: in a sandbox holding ``CAP_SYS_ADMIN`` over its own ``/tmp`` and ``/dev/shm``
            tmpfs mounts: their inode limit, after which :data:`PRELUDE` gives up every
            capability (-1: not a sandbox; neither happens).
    """
    max_processes = spec.max_processes if max_processes is None else max_processes
    limits = (uid, math.ceil(timeout), spec.memory_mb * 2**20, max_processes,
              spec.scratch_mb * 2**20, MAX_OPEN_FILES, inodes)
    return [python, "-I", "-u", "-X", "utf8", "-c", PRELUDE, *map(str, limits)]


def run_bounded(argv: list[str], code: str, *, timeout: float, max_output_bytes: int,
                kill: Callable[[subprocess.Popen], None], **popen_kwargs) -> Execution:
    """Run ``argv`` with ``code`` on its stdin; its output (stdout and stderr interleaved) read up
    to ``max_output_bytes``. At ``timeout`` seconds or one byte past the bound, ``kill(process)``
    stops it; this returns once ``argv``'s process has been reaped (``kill`` makes sure its
    descendants are gone with it).

    Args:
        argv: the command line.
        code: written to its stdin.
        timeout: the wall-clock limit, in seconds.
        max_output_bytes: the most output read.
        kill: stops the process (and its descendants).
        **popen_kwargs: passed to ``subprocess.Popen``.
    """
    process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, **popen_kwargs)
    deadline = time.monotonic() + timeout
    output, end = bytearray(), "interrupted"  # until the exchange below returns
    try:
        end = _exchange(process, code.encode("utf-8"), output, deadline, max_output_bytes)
        if end is None:  # its output is closed: it may still run
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                end = "timeout"
    finally:
        if end is not None:
            kill(process)
            try:
                process.wait(5.0)
            except subprocess.TimeoutExpired:  # ``kill`` missed it: the process itself, at least
                process.kill()
        process.wait()
        for pipe in (process.stdin, process.stdout):
            pipe.close()
    text = bytes(output[:max_output_bytes]).decode("utf-8", "replace").strip()
    return Execution(text, end or "exit", returncode=process.returncode if end is None else None)


def _exchange(process: subprocess.Popen, data: bytes, output: bytearray, deadline: float,
              max_output_bytes: int) -> str | None:
    """Write ``data`` to the process's stdin while reading its stdout into ``output``, without
    blocking on either; ``"timeout"`` or ``"output_limit"`` where it had to stop, None once the
    output closed."""
    pending = memoryview(data)
    with selectors.DefaultSelector() as selector:
        os.set_blocking(process.stdin.fileno(), False)
        selector.register(process.stdin, selectors.EVENT_WRITE)
        selector.register(process.stdout, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            for key, _ in selector.select(left):
                if key.fileobj is process.stdin:  # at most PIPE_BUF: a write that never blocks
                    try:
                        pending = pending[os.write(key.fd, pending[:select.PIPE_BUF]):]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:  # it stopped reading (exited): nothing more to send
                        pending = pending[:0]
                    if not pending:
                        selector.unregister(process.stdin)
                        process.stdin.close()
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(process.stdout)
                output += chunk
                if len(output) > max_output_bytes:
                    return "output_limit"
    return None


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL ``process``'s process group (it was started in a session of its own).

    Args:
        process: a process started in a session of its own.
    """
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class UnsandboxedProcess:
    """``env.python_sandbox=none``: the code runs in a new interpreter (``python -I``, an empty
    environment but ``PATH``, a fresh temporary directory) under :data:`PRELUDE`'s limits, as the
    trainer's user, with the trainer's view of the files, the network and its processes. At a limit
    its process group is killed (a process that left the group survives). For trusted code only;
    the first one built in a process logs a warning.

    Args:
        spec: the limits.
        python: the interpreter (None: this one).
    """

    _warned = False

    def __init__(self, spec: SandboxSpec, python: str | None = None):
        import sys

        self.spec, self.python = spec, python or sys.executable
        if not UnsandboxedProcess._warned:
            UnsandboxedProcess._warned = True
            log.warning("env.python_sandbox=none: the python tool runs the policy's code WITHOUT "
                        "a sandbox, as this user, with its files, network and processes in reach. "
                        "Use env.python_sandbox=bubblewrap (apt-get install bubblewrap) or remote.")

    def run(self, code: str, timeout: float | None = None) -> Execution:
        """Run ``code``; ``timeout`` (seconds, at most ``spec.timeout``) stops it sooner.

        Args:
            code: the Python source.
            timeout: seconds, at most ``spec.timeout`` (None: ``spec.timeout``).
        """
        timeout = self.spec.timeout if timeout is None else min(self.spec.timeout, timeout)
        # no process limit: RLIMIT_NPROC counts all of this user's processes (or none, for root)
        argv = python_command(self.python, self.spec, timeout, max_processes=-1)
        with tempfile.TemporaryDirectory(prefix="rlhf_tool_") as workdir:
            return run_bounded(argv, code, timeout=timeout, kill=kill_group,
                               max_output_bytes=self.spec.max_output_bytes, cwd=workdir,
                               env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                               start_new_session=True)
