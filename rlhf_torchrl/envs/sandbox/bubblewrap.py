"""The python tool's operating-system sandbox: bubblewrap (``bwrap``) with a seccomp filter.

Each call gets (flags of ``bwrap``, in :meth:`BubblewrapSandbox.command`):

- new network, PID, IPC, UTS and cgroup namespaces: no network at all (not even the host's
  loopback), ``/proc`` shows only its own processes, System V objects die with the call, and
  killing the namespace's first process kills every process it started (``--die-with-parent``:
  also when the trainer dies);
- a root of its own, read-only, holding only ``/usr`` (and the ``/bin``, ``/lib*`` links into
  it), the loader's files from ``/etc``, the interpreter's prefix (``sys.base_prefix``,
  ``sys.prefix``) and ``/dev``'s null, zero, full, random and urandom: the trainer's files,
  checkpoints, home and secrets are not there, nor a terminal;
- two private tmpfs mounts, memory-backed and gone after the call: ``/tmp`` of ``scratch_mb`` (the
  working directory) and ``/dev/shm`` of :data:`SHM_MB` (``multiprocessing``'s semaphores), each
  with :func:`inode_limit` inodes (set by :data:`~.process.PRELUDE`: ``bwrap`` sets sizes only);
- an empty environment (``--clearenv``), no inherited file descriptors, a new session;
- an unprivileged user with no capabilities. Run as root, ``bwrap`` maps its sandbox user to
  root outside, and the kernel never enforces RLIMIT_NPROC for root; so as root the sandbox
  skips the user namespace and the interpreter's first statements switch to a uid of its own
  for this call (:data:`~.process.PRELUDE`); otherwise ``bwrap`` runs it as ``nobody`` in a user
  namespace. Either way the prelude holds ``CAP_SYS_ADMIN`` over its own mounts to set their
  inode limits, then gives up every capability before the code runs;
- a seccomp filter (:mod:`.seccomp`): no user namespaces, no memory outside the address-space
  limit (memfd, secret memory, System V and POSIX IPC), no network sockets, no socket or pipe
  buffers above the defaults, no kernel keyrings, eBPF, perf events, userfaultfd or io_uring;
- limits (``setrlimit``): processes, CPU time, address space per process, file size, open files;
- where cgroup v2 delegates its memory controller (:mod:`.cgroup`), a cgroup of its own whose
  ``memory.max`` (:meth:`BubblewrapSandbox.memory_max`) counts the kernel's memory too.
"""

from __future__ import annotations

import os
import re
import secrets
import select
import shutil
import signal
import stat
import subprocess
import sys
import threading

from rlhf_torchrl.envs.sandbox import Execution, SandboxSpec
from rlhf_torchrl.envs.sandbox.cgroup import CallCgroup, call_parent
from rlhf_torchrl.envs.sandbox.process import python_command, run_bounded
from rlhf_torchrl.envs.sandbox.seccomp import seccomp_filter
from rlhf_torchrl.errors import ConfigError

# the system's part of the sandbox's root: directories (or /usr-merged links) and the loader's files
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime")
# /dev: the host's device nodes a program reads or writes, and the links to its own descriptors.
# Not ``bwrap --dev``: its tmpfs is writable by the sandbox's user in a user namespace (half the
# host's memory in size), and mounting its ``/dev/pts`` makes ``bwrap`` nest a second user
# namespace, over whose mounts the sandbox holds no capability (no inode limit could be set)
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
_DEVICE_LINKS = {"/dev/fd": "/proc/self/fd", "/dev/stdin": "/proc/self/fd/0",
                 "/dev/stdout": "/proc/self/fd/1", "/dev/stderr": "/proc/self/fd/2"}
#: the size of the private ``/dev/shm``, in MiB
SHM_MB = 16
# the whole environment inside; one thread per numeric library (threads count as processes)
_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_NOBODY = 65534
#: the uids a call runs as when the trainer is root, one drawn per call: no file or process of
#: the machine belongs to them, and each call's processes are counted apart
UID_RANGE = (2**30, 2**31 - 2)

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
        self._setuid = self.bwrap is not None and bool(os.stat(self.bwrap).st_mode & stat.S_ISUID)
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

    def memory_max(self) -> int:
        """The call's ``memory.max`` in bytes, where it gets a cgroup: the worst case its limits
        allow (every process at its address-space limit, both tmpfs mounts full), which the
        cgroup makes hold for the kernel's memory too."""
        return (self.spec.max_processes * self.spec.memory_mb + self.spec.scratch_mb + SHM_MB) * 2**20

    def command(self, timeout: float, *, uid: int, info_fd: int, seccomp_fd: int | None) -> list[str]:
        """The ``bwrap`` command line running :data:`~.process.PRELUDE` for one call.

        Args:
            timeout: the call's CPU-time limit, in seconds.
            uid: the uid the code runs as when the trainer is root.
            info_fd: the file descriptor ``bwrap`` writes its child's pid to.
            seccomp_fd: the file descriptor of the seccomp program (None: no filter).
        """
        # the prelude limits its tmpfs mounts' inodes with CAP_SYS_ADMIN over them, then drops it.
        # In a user namespace that needs the namespace owning the mounts: ``--disable-userns``
        # nests another, so it stays only where no seccomp filter refuses user namespaces, or
        # where a setuid ``bwrap`` refuses ``--cap-add`` (the mounts then keep bubblewrap's sizes,
        # and the kernel's default inode count)
        limit_inodes = self.privileged or (seccomp_fd is not None and not self._setuid)
        if self.privileged:  # no user namespace: the prelude drops root for ``uid``
            isolation = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                         "--unshare-cgroup-try", "--cap-drop", "ALL", "--cap-add", "CAP_SETUID",
                         "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SYS_ADMIN"]
        else:
            isolation = ["--unshare-all", "--unshare-user", "--uid", str(_NOBODY),
                         "--gid", str(_NOBODY), "--cap-drop", "ALL"]
            isolation += ["--cap-add", "CAP_SYS_ADMIN"] if limit_inodes else ["--disable-userns"]
        argv = [self.bwrap, *isolation, "--die-with-parent", "--new-session", "--clearenv"]
        for name, value in _ENV.items():
            argv += ["--setenv", name, value]
        argv += ["--info-fd", str(info_fd)]
        if seccomp_fd is not None:
            argv += ["--seccomp", str(seccomp_fd)]
        # the scratch folder first: an interpreter under /tmp (a venv) is then mounted inside it
        argv += ["--perms", "01777", "--size", str(self.spec.scratch_mb * 2**20), "--tmpfs", "/tmp",
                 *self._mounts, "--proc", "/proc", "--perms", "0755", "--dir", "/dev"]
        for device in _DEVICES:
            argv += ["--dev-bind-try", device, device]
        for link, target in _DEVICE_LINKS.items():
            argv += ["--symlink", target, link]
        argv += ["--perms", "01777", "--size", str(SHM_MB * 2**20), "--tmpfs", "/dev/shm",
                 "--chdir", "/tmp", "--remount-ro", "/", "--"]
        return argv + python_command(self.python, self.spec, timeout,
                                     uid=uid if self.privileged else -1,
                                     inodes=inode_limit(self.spec.scratch_mb) if limit_inodes else -1)

    def run(self, code: str, timeout: float | None = None) -> Execution:
        """Run ``code``; ``timeout`` (seconds, at most ``spec.timeout``) stops it sooner.

        Args:
            code: the Python source.
            timeout: seconds, at most ``spec.timeout`` (None: ``spec.timeout``).
        """
        return self._run(code, self.spec.timeout if timeout is None else min(self.spec.timeout, timeout))

    def _run(self, code: str, timeout: float) -> Execution:
        uid = UID_RANGE[0] + secrets.randbelow(UID_RANGE[1] - UID_RANGE[0])
        # a cgroup where one can be made; ``run_as`` (tests) starts bwrap as a user who may not
        # move itself into it
        parent = call_parent()[0] if self.run_as is None else None
        if parent is None:
            return self._run_in(code, timeout, uid, None)
        try:
            cgroup = CallCgroup(parent, self.memory_max())
        except OSError as e:
            return Execution("", "error", message=f"cannot make the call's cgroup: {e}")
        with cgroup:
            return self._run_in(code, timeout, uid, cgroup)

    def _run_in(self, code: str, timeout: float, uid: int, cgroup: CallCgroup | None) -> Execution:
        info_read, info_write = os.pipe()
        fds = [info_write]
        program = seccomp_filter()
        if program is not None:  # the program (under a kilobyte) fits the pipe's buffer
            seccomp_read, seccomp_write = os.pipe()
            os.write(seccomp_write, program)
            os.close(seccomp_write)
            fds.append(seccomp_read)
        user = ({"user": self.run_as, "group": self.run_as, "extra_groups": []}
                if self.run_as is not None else {})
        argv = self.command(timeout, uid=uid, info_fd=info_write,
                            seccomp_fd=fds[1] if program is not None else None)
        if cgroup is not None:
            argv = cgroup.enter(argv)
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


def inode_limit(scratch_mb: int) -> int:
    """Inodes of each of a call's tmpfs mounts: one per 16 KiB of ``scratch_mb``, at least 1024.
    An empty file costs about 1 KiB of kernel memory (inode and dentry) and no space: the inodes
    then hold at most a sixteenth of the scratch size (4096 and 4 MiB for the default 64 MB)."""
    return max(1024, scratch_mb * 64)


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
