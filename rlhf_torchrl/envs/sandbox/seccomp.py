"""The python tool's seccomp filter: the system calls its programs never need, refused.

Each refused call either escapes the sandbox's limits or holds host memory that no limit of the
sandbox counts (RLIMIT_AS counts a process's mappings; the kernel objects below are not mappings,
and most outlive the process that made them until the IPC namespace or the file goes):

- user namespaces (inside one a program is root: its own tmpfs mounts, more kernel code);
- memory outside the address space: ``memfd_create`` and ``memfd_secret`` (pages that stay in the
  file once unmapped), System V shared memory, message queues and semaphores, POSIX message
  queues (each ``semget`` of 32000 semaphores holds 2 MiB of kernel memory);
- other kernel objects that hold memory per call: inotify watches, POSIX timers, kernel keyrings;
- sockets of any family but ``AF_UNIX`` (no network exists inside; TCP over its loopback holds up
  to ``tcp_wmem + tcp_rmem`` per connection, from a pool the host's own TCP shares), raising a
  socket's buffer above ``net.core.wmem_default`` (``SO_SNDBUF``, ``SO_RCVBUF``), and raising a
  pipe's above 64 KiB (``F_SETPIPE_SZ``);
- kernel surface no program needs: eBPF, perf events, userfaultfd, io_uring.

Python needs none of these: its own start, ``subprocess``, ``multiprocessing`` (POSIX semaphores
are files in ``/dev/shm``) and ``asyncio`` (a ``socketpair`` of ``AF_UNIX``) run unchanged.

The program is classic BPF over ``struct seccomp_data`` (``nr`` at offset 0, ``arch`` at 4, the
six arguments from 16, eight bytes each: their low word first on these little-endian machines),
as ``bwrap --seccomp FD`` and ``prctl(PR_SET_SECCOMP)`` read it: ``struct sock_filter`` (code u16,
jt u8, jf u8, k u32) per instruction, jumps counted from the next instruction.
"""

from __future__ import annotations

import errno
import platform
import struct

# syscall numbers (x86_64, aarch64; None: the call does not exist there):
# arch/x86/entry/syscalls/syscall_64.tbl, include/uapi/asm-generic/unistd.h
SYSCALLS = {
    "unshare": (272, 97), "clone": (56, 220), "clone3": (435, 435),
    "socket": (41, 198), "socketpair": (53, 199), "setsockopt": (54, 208), "fcntl": (72, 25),
    "memfd_create": (319, 279), "memfd_secret": (447, 447),
    "shmget": (29, 194), "msgget": (68, 186), "semget": (64, 190), "mq_open": (240, 180),
    "inotify_init": (253, None), "inotify_init1": (294, 26), "fanotify_init": (300, 262),
    "timer_create": (222, 107),
    "add_key": (248, 217), "request_key": (249, 218), "keyctl": (250, 219),
    "bpf": (321, 280), "perf_event_open": (298, 241), "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
}
#: refused whatever their arguments. Making the object is enough to refuse: a new IPC namespace
#: holds no queue, semaphore or segment that ``msgsnd``, ``semop`` or ``shmat`` could reach.
DENIED = ("memfd_create", "memfd_secret", "shmget", "msgget", "semget", "mq_open", "inotify_init",
          "inotify_init1", "fanotify_init", "timer_create", "add_key", "request_key", "keyctl",
          "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
          "io_uring_register")

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_BIT = 0x40000000  # x86_64's x32 ABI: the same numbers plus this bit
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|..|K, BPF_RET|K
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO
_NR, _ARCH = 0, 4
_CLONE_NEWUSER = 0x10000000
_AF_UNIX, _SOL_SOCKET, _F_SETPIPE_SZ = 1, 1, 1031
_SO_BUFFERS = (7, 8, 32, 33)  # SO_SNDBUF, SO_RCVBUF, SO_SNDBUFFORCE, SO_RCVBUFFORCE


def _arg(index: int) -> tuple:
    """Load the low 32 bits of argument ``index``: flags, families, levels and names are ints."""
    return (_LD_ABS, 0, 0, 16 + 8 * index)


def _when(nr: int, body: list[tuple]) -> list[tuple]:
    """``body`` (every path of which returns) for syscall ``nr``; other calls jump past it."""
    return [(_JEQ, 0, len(body), nr), *body]


def _refuse_if_any(index: int, values: tuple[int, ...], refuse: int) -> list[tuple]:
    """Return ``refuse`` when argument ``index`` is one of ``values``, else allow."""
    body = [_arg(index)]
    body += [(_JEQ, len(values) - i, 0, value) for i, value in enumerate(values)]
    return body + [(_RET, 0, 0, _ALLOW), (_RET, 0, 0, refuse)]


def seccomp_filter(machine: str | None = None) -> bytes | None:
    """The seccomp program for ``machine`` (default: this one), or None where its syscall numbers
    are not listed here (the sandbox then runs without one; the module's docstring says what it
    refuses).

    Fails with EPERM: another architecture's calls (32-bit, x32), :data:`DENIED`, ``unshare`` and
    ``clone`` with ``CLONE_NEWUSER``, ``setsockopt`` of a socket's buffer sizes and ``fcntl(
    F_SETPIPE_SZ)``; ``socket`` and ``socketpair`` of any family but ``AF_UNIX`` fail with
    EAFNOSUPPORT (as on a kernel without that family); ``clone3`` fails with ENOSYS (its flags sit
    in memory a filter cannot read; the C library then falls back to ``clone``).

    Args:
        machine: a ``platform.machine()`` name (None: this machine's).

    Example::

        >>> len(seccomp_filter("x86_64")) % 8, seccomp_filter("riscv64")
        (0, None)
    """
    machine = machine or platform.machine()
    if machine not in _AUDIT_ARCH:
        return None
    nr = {name: numbers[machine == "aarch64"] for name, numbers in SYSCALLS.items()}
    deny = _ERRNO | errno.EPERM
    no_family = _ERRNO | errno.EAFNOSUPPORT
    program = [(_LD_ABS, 0, 0, _ARCH), (_JEQ, 1, 0, _AUDIT_ARCH[machine]), (_RET, 0, 0, deny),
               (_LD_ABS, 0, 0, _NR)]
    if machine == "x86_64":
        program += [(_JGE, 0, 1, _X32_BIT), (_RET, 0, 0, deny)]
    for name in DENIED:
        if nr[name] is not None:
            program += [(_JEQ, 0, 1, nr[name]), (_RET, 0, 0, deny)]
    program += [(_JEQ, 0, 1, nr["clone3"]), (_RET, 0, 0, _ERRNO | errno.ENOSYS)]
    for name in ("unshare", "clone"):  # the flags are the first argument of both
        program += _when(nr[name], [_arg(0), (_JSET, 0, 1, _CLONE_NEWUSER), (_RET, 0, 0, deny),
                                    (_RET, 0, 0, _ALLOW)])
    for name in ("socket", "socketpair"):  # the family is the first argument of both
        program += _when(nr[name], [_arg(0), (_JEQ, 0, 1, _AF_UNIX), (_RET, 0, 0, _ALLOW),
                                    (_RET, 0, 0, no_family)])
    # setsockopt(fd, level, name, ...): SOL_SOCKET's buffer sizes
    program += _when(nr["setsockopt"], [_arg(1), (_JEQ, 1, 0, _SOL_SOCKET), (_RET, 0, 0, _ALLOW),
                                        *_refuse_if_any(2, _SO_BUFFERS, deny)])
    program += _when(nr["fcntl"], _refuse_if_any(1, (_F_SETPIPE_SZ,), deny))
    program += [(_RET, 0, 0, _ALLOW)]
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in program)
