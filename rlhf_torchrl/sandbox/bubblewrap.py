"""The python tool's operating-system sandbox: bubblewrap (``bwrap``) with a seccomp filter.

Each call gets (flags of ``bwrap``, in :meth:`BubblewrapSandbox.command`):

- new network, PID, IPC, UTS and cgroup namespaces: no network at all (not even the host's
  loopback), ``/proc`` shows only its own processes, and killing the namespace's first process
  kills every process it started (``--die-with-parent``: also when the trainer dies);
- a root of its own, read-only, holding only ``/usr`` (and the ``/bin``, ``/lib*`` links into
  it), the loader's files from ``/etc`` and the interpreter's prefix (``sys.base_prefix``,
  ``sys.prefix``): the trainer's files, checkpoints, home and secrets are not there;
- a private ``/tmp`` of ``scratch_mb`` (memory-backed, gone after the call) as working directory;
- an empty environment (``--clearenv``), no inherited file descriptors, a new session;
- an unprivileged user with no capabilities. Run as root, ``bwrap`` maps its sandbox user to
  root outside, and the kernel never enforces RLIMIT_NPROC for root; so as root the sandbox
  skips the user namespace and the interpreter's first statements switch to a uid of its own
  for this call (:data:`~.process.PRELUDE`); otherwise ``bwrap`` runs it as ``nobody`` in a user
  namespace, and nested user namespaces are disabled;
- a seccomp filter (:func:`seccomp_filter`): no user namespaces (whose tmpfs mounts would escape
  the memory limit), no SysV shared memory or memfd (memory outside the address-space limit), no
  kernel keyrings, eBPF, perf events, userfaultfd or io_uring;
- limits (``setrlimit``): processes, CPU time, address space per process, file size, open files.
"""

from __future__ import annotations

import errno
import os
import platform
import re
import secrets
import select
import shutil
import signal
import struct
import subprocess
import sys
import threading

from ..errors import ConfigError
from . import Execution, SandboxSpec
from .process import python_command, run_bounded

# the system's part of the sandbox's root: directories (or /usr-merged links) and the loader's files
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime")
# the whole environment inside; one thread per numeric library (threads count as processes)
_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_NOBODY = 65534
#: the uids a call runs as when the trainer is root, one drawn per call: no file or process of
#: the machine belongs to them, and each call's processes are counted apart
UID_RANGE = (2**30, 2**31 - 2)

# ---- seccomp --------------------------------------------------------------------------------
# syscall numbers (x86_64, aarch64): include/uapi/asm-generic/unistd.h, arch/x86/.../syscall_64.tbl
_SYSCALLS = {
    "unshare": (272, 97), "clone": (56, 220), "clone3": (435, 435),
    "shmget": (29, 194), "memfd_create": (319, 279),
    "add_key": (248, 217), "request_key": (249, 218), "keyctl": (250, 219),
    "bpf": (321, 280), "perf_event_open": (298, 241), "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
}
_DENIED = ("shmget", "memfd_create", "add_key", "request_key", "keyctl", "bpf", "perf_event_open",
           "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register")
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|..|K, BPF_RET|K
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO
_CLONE_NEWUSER = 0x10000000
_X32_BIT = 0x40000000


def seccomp_filter(machine: str | None = None) -> bytes | None:
    """The seccomp program (classic BPF, as ``bwrap --seccomp`` reads it) for ``machine``
    (default: this one), or None where its syscall numbers are not listed here.

    Fails with EPERM: another architecture's syscalls (32-bit, x32), ``unshare``/``clone`` with
    ``CLONE_NEWUSER``, and :data:`_DENIED`; ``clone3`` fails with ENOSYS (its flags sit in memory
    a filter cannot read; the C library then falls back to ``clone``).

    Args:
        machine: a ``platform.machine()`` name (None: this machine's).
    """
    machine = machine or platform.machine()
    if machine not in _AUDIT_ARCH:
        return None
    nr = {name: numbers[machine == "aarch64"] for name, numbers in _SYSCALLS.items()}
    deny = _ERRNO | errno.EPERM
    program = [(_LD_ABS, 0, 0, 4), (_JEQ, 1, 0, _AUDIT_ARCH[machine]), (_RET, 0, 0, deny),
               (_LD_ABS, 0, 0, 0)]  # seccomp_data: nr at 0, arch at 4, args[0] at 16
    if machine == "x86_64":
        program += [(_JGE, 0, 1, _X32_BIT), (_RET, 0, 0, deny)]
    for name in _DENIED:
        program += [(_JEQ, 0, 1, nr[name]), (_RET, 0, 0, deny)]
    program += [(_JEQ, 0, 1, nr["clone3"]), (_RET, 0, 0, _ERRNO | errno.ENOSYS),
                (_JEQ, 2, 0, nr["unshare"]), (_JEQ, 1, 0, nr["clone"]), (_RET, 0, 0, _ALLOW),
                (_LD_ABS, 0, 0, 16), (_JSET, 0, 1, _CLONE_NEWUSER), (_RET, 0, 0, deny),
                (_RET, 0, 0, _ALLOW)]
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in program)


# ---- the sandbox ----------------------------------------------------------------------------
_checked: dict[tuple, str | None] = {}  # (bwrap, python, spec, run_as) -> why it cannot run, or None
_checked_lock = threading.Lock()


class BubblewrapSandbox:
    """Runs Python code in a ``bwrap`` sandbox with ``spec``'s limits (the module's docstring
    lists what it isolates).

    Args:
        spec: the limits.
        python: the interpreter (None: this one, its prefix mounted read-only).
        run_as: a uid to start ``bwrap`` as, which takes the path of a trainer that is not root
            (user namespaces); for tests, as root. None: this process's user.

    Example::

        >>> BubblewrapSandbox(SandboxSpec(timeout=5.0)).run("print(6 * 7)").output
        '42'
    """

    def __init__(self, spec: SandboxSpec, *, python: str | None = None, run_as: int | None = None):
        self.spec, self.python, self.run_as = spec, python or sys.executable, run_as
        self.bwrap = shutil.which("bwrap")
        self.privileged = run_as is None and os.geteuid() == 0
        self._mounts = _mounts(self.python)

    def check(self) -> None:
        """Raise :class:`ConfigError` (one line) unless ``bwrap`` is installed and runs Python
        here with these limits; checked once per process."""
        if self.bwrap is None:
            raise ConfigError(
                "env.python_sandbox=bubblewrap: bwrap is not installed, and the python tool runs "
                "the policy's code in it. Install it (apt-get install bubblewrap), send the code "
                "to a sandbox service (env.python_sandbox=remote env.sandbox_url=http://HOST:8080/"
                "run_code), or run it unsandboxed (env.python_sandbox=none).")
        key = (self.bwrap, self.python, self.spec, self.run_as)
        with _checked_lock:
            if key not in _checked:
                trial = self._run("print(6 * 7)", 60.0)  # whatever the limit: a busy machine
                ok = trial.end == "exit" and trial.returncode == 0 and trial.output == "42"
                _checked[key] = None if ok else (trial.output or trial.message or trial.end)
        problem = _checked[key]
        if problem is not None:
            last = problem.strip().splitlines()[-1] if problem.strip() else problem
            raise ConfigError(
                f"env.python_sandbox=bubblewrap: bwrap cannot run Python here ({last}). Where "
                "user namespaces are off, turn them on (sysctl kernel.unprivileged_userns_clone=1; "
                "on Ubuntu 24.04 an AppArmor profile for bwrap); a memory error means "
                "env.python_memory_mb is too small; or use env.python_sandbox=remote or none.")

    def command(self, timeout: float, *, uid: int, info_fd: int, seccomp_fd: int | None) -> list[str]:
        """The ``bwrap`` command line running :data:`~.process.PRELUDE` for one call.

        Args:
            timeout: the call's CPU-time limit, in seconds.
            uid: the uid the code runs as when the trainer is root.
            info_fd: the file descriptor ``bwrap`` writes its child's pid to.
            seccomp_fd: the file descriptor of the seccomp program (None: no filter).
        """
        if self.privileged:  # no user namespace: the prelude drops root for ``uid``
            isolation = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                         "--unshare-cgroup-try", "--cap-drop", "ALL",
                         "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            isolation = ["--unshare-all", "--unshare-user", "--disable-userns",
                         "--uid", str(_NOBODY), "--gid", str(_NOBODY), "--cap-drop", "ALL"]
        argv = [self.bwrap, *isolation, "--die-with-parent", "--new-session", "--clearenv"]
        for name, value in _ENV.items():
            argv += ["--setenv", name, value]
        argv += ["--info-fd", str(info_fd)]
        if seccomp_fd is not None:
            argv += ["--seccomp", str(seccomp_fd)]
        # the scratch folder first: an interpreter under /tmp (a venv) is then mounted inside it
        argv += ["--perms", "01777", "--size", str(self.spec.scratch_mb * 2**20), "--tmpfs", "/tmp",
                 *self._mounts, "--proc", "/proc", "--dev", "/dev", "--chdir", "/tmp",
                 "--remount-ro", "/", "--"]
        return argv + python_command(self.python, self.spec, timeout,
                                     uid=uid if self.privileged else -1)

    def run(self, code: str, timeout: float | None = None) -> Execution:
        """Run ``code``; ``timeout`` (seconds, at most ``spec.timeout``) stops it sooner.

        Args:
            code: the Python source.
            timeout: seconds, at most ``spec.timeout`` (None: ``spec.timeout``).
        """
        return self._run(code, self.spec.timeout if timeout is None else min(self.spec.timeout, timeout))

    def _run(self, code: str, timeout: float) -> Execution:
        uid = UID_RANGE[0] + secrets.randbelow(UID_RANGE[1] - UID_RANGE[0])
        info_read, info_write = os.pipe()
        fds = [info_write]
        program = seccomp_filter()
        if program is not None:  # the program (a few hundred bytes) fits the pipe's buffer
            seccomp_read, seccomp_write = os.pipe()
            os.write(seccomp_write, program)
            os.close(seccomp_write)
            fds.append(seccomp_read)
        user = ({"user": self.run_as, "group": self.run_as, "extra_groups": []}
                if self.run_as is not None else {})
        argv = self.command(timeout, uid=uid, info_fd=info_write,
                            seccomp_fd=fds[1] if program is not None else None)
        try:
            execution = run_bounded(
                argv, code, timeout=timeout, max_output_bytes=self.spec.max_output_bytes,
                kill=lambda process: _kill_namespace(process, info_read), pass_fds=fds, env={},
                start_new_session=True, **user)
        finally:
            for fd in (info_read, *fds):
                os.close(fd)
        if execution.end == "exit" and execution.returncode > 128:  # bwrap: 128 + the signal
            execution.returncode = 128 - execution.returncode
        return execution


def _kill_namespace(process: subprocess.Popen, info_fd: int) -> None:
    """SIGKILL the sandbox's PID namespace: its first process (``bwrap --info-fd`` names it) dies,
    the kernel kills every other process in it, and ``bwrap`` exits once they are gone."""
    data, ready = b"", select.poll()
    ready.register(info_fd, select.POLLIN)
    while ready.poll(0):
        chunk = os.read(info_fd, 4096)
        if not chunk:
            break
        data += chunk
    match = re.search(rb'"child-pid":\s*(\d+)', data)
    if match and process.poll() is None:
        try:
            os.kill(int(match[1]), signal.SIGKILL)
            return
        except ProcessLookupError:
            pass
    process.kill()  # bwrap itself: --die-with-parent takes the namespace down with it


def _mounts(python: str) -> list[str]:
    """``bwrap`` arguments for the read-only system directories and the interpreter's prefix."""
    args = []
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):  # /usr-merged: /lib -> usr/lib
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in _SYSTEM_FILES:
        args += ["--ro-bind-try", path, path]
    if python == sys.executable:
        prefixes = {sys.base_prefix, sys.prefix, sys.base_exec_prefix, sys.exec_prefix}
    else:
        prefixes = {os.path.dirname(os.path.dirname(os.path.realpath(python)))}
    bound, made = [path for path in _SYSTEM_DIRS if os.path.isdir(path)], set()
    for prefix in sorted(os.path.abspath(p) for p in prefixes):
        if any(prefix == b or prefix.startswith(b.rstrip("/") + "/") for b in bound):
            continue
        parent = os.path.dirname(prefix)
        ancestors = []
        while parent not in ("/", "") and parent not in made:
            ancestors.append(parent)
            parent = os.path.dirname(parent)
        for directory in reversed(ancestors):  # traversable, whatever the host's mode (/root: 0700)
            args += ["--perms", "0755", "--dir", directory]
            made.add(directory)
        args += ["--ro-bind", prefix, prefix]
        bound.append(prefix)
    return args
