"""A cgroup (v2) per python-tool call, whose ``memory.max`` counts the kernel memory it holds too.

Resource limits count a process's own mappings. The kernel memory a program makes the kernel hold
(tmpfs pages and inodes, pipe buffers, page tables, System V objects) is charged to its memory
cgroup instead, and ``memory.max`` bounds it all at once: past it, the kernel reclaims or kills
inside the call (``memory.oom.group``: the whole call), never the trainer. ``AF_UNIX`` socket
buffers are charged to no cgroup; :mod:`.seccomp` and ``RLIMIT_NOFILE`` bound them.

Calls get children of the trainer's own cgroup, which needs the memory controller delegated to it
(a cgroup v2 hierarchy, writable: root, ``systemd-run --scope -p Delegate=yes``, or a container
with its own cgroup namespace). The kernel lets a cgroup pass a controller to its children only
while no process sits in it, so where the trainer's cgroup holds the trainer, the trainer moves
itself into a child of its own (``rlhf-trainer-PID``; what nsjail and systemd's delegation rules
do), and the processes it starts later make their calls' cgroups beside it; with other processes
in the trainer's cgroup too, no cgroup is made. :func:`call_parent` says why not.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import threading
import time

log = logging.getLogger(__name__)

_lock = threading.Lock()
_parent: tuple[str | None, str] | None = None  # (where calls' cgroups go, or None; why not)
_names = itertools.count()


def call_parent() -> tuple[str | None, str]:
    """The cgroup (a directory) in which this process makes its calls' cgroups, found or set up
    once per process: ``(path, "")``, or ``(None, why none can be made)``."""
    global _parent
    with _lock:
        if _parent is None:
            _parent = _find_parent()
            if _parent[0] is None:
                log.info("python tool: no cgroup per call (%s)", _parent[1])
        return _parent


def _find_parent() -> tuple[str | None, str]:
    mount = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[fields.index("-") + 1] == "cgroup2":
                mount = fields[4]
                break
    if mount is None:
        return None, "no cgroup v2 hierarchy is mounted"
    with open("/proc/self/cgroup") as f:
        relative = next((line[3:].strip() for line in f if line.startswith("0::")), None)
    own = os.path.normpath(os.path.join(mount, (relative or "/").lstrip("/")))
    try:
        if "memory" not in _read(own, "cgroup.controllers").split():
            return None, (f"cgroup v2's memory controller is not delegated to {own} (a cgroup v1 "
                          "hierarchy may hold it)")
        if "memory" in _read(own, "cgroup.subtree_control").split():
            return own, ""
        above = os.path.dirname(own)  # a trainer process moved there, then started this one
        if (os.path.basename(own).startswith("rlhf-trainer-")
                and "memory" in _read(above, "cgroup.subtree_control").split()):
            return above, ""
    except OSError as e:
        return None, f"cannot read {own}: {e.strerror}"
    try:
        _write(own, "cgroup.subtree_control", "+memory")
        return own, ""
    except OSError as e:
        if e.errno != errno.EBUSY:  # not this user's to delegate
            return None, f"cannot enable the memory controller under {own}: {e.strerror}"
    leaf = os.path.join(own, f"rlhf-trainer-{os.getpid()}")  # EBUSY: processes sit in ``own``
    try:
        os.mkdir(leaf)
        _write(leaf, "cgroup.procs", "0")  # this process, all its threads
    except OSError as e:
        _remove(leaf)
        return None, f"cannot move the trainer into {leaf}: {e.strerror}"
    try:
        _write(own, "cgroup.subtree_control", "+memory")
        return own, ""
    except OSError as e:
        _write(own, "cgroup.procs", "0")  # back where it was
        _remove(leaf)
        return None, (f"other processes share the trainer's cgroup {own} ({e.strerror}): start "
                      "the trainer in a cgroup of its own")


class CallCgroup:
    """A new cgroup for one call under :func:`call_parent`, with ``memory.max`` of ``limit_bytes``,
    no swap, and one OOM kill for the whole call; removed (anything left in it killed) at the
    ``with`` block's end. Raises :class:`OSError` where it cannot be made.

    Args:
        parent: the directory :func:`call_parent` gave.
        limit_bytes: ``memory.max``.

    Example::

        with CallCgroup(call_parent()[0], 2**30) as cgroup:
            subprocess.run(cgroup.enter(["python", "-c", "print(1)"]))
    """

    def __init__(self, parent: str, limit_bytes: int):
        self.path = os.path.join(parent, f"rlhf-call-{os.getpid()}-{next(_names)}")
        os.mkdir(self.path)
        try:
            _write(self.path, "memory.max", str(limit_bytes))
            for name, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                if os.path.exists(os.path.join(self.path, name)):  # swap accounting may be off
                    _write(self.path, name, value)
        except BaseException:
            os.rmdir(self.path)
            raise

    def __enter__(self) -> CallCgroup:
        return self

    def enter(self, argv: list[str]) -> list[str]:
        """``argv`` started from a shell that first moves itself into this cgroup: everything it
        starts is counted from its first allocation (moving a running process would miss what it
        allocated before the move)."""
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"',
                os.path.join(self.path, "cgroup.procs"), *argv]

    def __exit__(self, *exc) -> None:
        if os.path.exists(os.path.join(self.path, "cgroup.kill")):  # Linux 5.14
            _write(self.path, "cgroup.kill", "1")
        if not _remove(self.path):
            log.warning("python tool: could not remove the call's cgroup %s", self.path)


def _remove(path: str, wait: float = 5.0) -> bool:
    """rmdir ``path`` once its processes are gone (a killed process leaves it a little after)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                return False
        time.sleep(0.01)


def _read(directory: str, name: str) -> str:
    with open(os.path.join(directory, name)) as f:
        return f.read()


def _write(directory: str, name: str, value: str) -> None:
    with open(os.path.join(directory, name), "w") as f:
        f.write(value)
