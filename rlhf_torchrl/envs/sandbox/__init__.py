"""Where the ``python`` tool runs the policy's programs: an operating-system sandbox, a sandbox
service, or (only where the user opts out) a plain subprocess.

The code a policy writes is untrusted: it may try to read the trainer's secrets, rewrite its reward
function, reach the network or exhaust the machine. ``env.python_sandbox`` picks the isolation:

- ``bubblewrap`` (:class:`~.bubblewrap.BubblewrapSandbox`, the default): each call runs in new
  namespaces (no network, its own process tree, a read-only view of the system directories the
  interpreter needs and nothing else, a private size-limited ``/tmp``) as an unprivileged user
  with no capabilities, under limits on processes, CPU time, wall-clock time, memory and output;
  at a limit the whole process tree is killed.
- ``remote`` (:class:`~.remote.RemoteSandbox`): the code goes over HTTP to a sandbox service with
  SandboxFusion's ``run_code`` API (what verl uses), for scale or where no user namespaces exist.
- ``none`` (:class:`~.process.UnsandboxedProcess`): a subprocess with resource limits and no
  isolation, for a trusted setting; a warning says so on every run.

Limits come from the config (:class:`SandboxSpec`), never from the call. The threat model, what
holds and what the user must still do: ``docs/security.md``.

Example::

    >>> sandbox = make_sandbox(SandboxSpec(timeout=5.0))
    >>> sandbox.run("print(6 * 7)").output
    '42'
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_torchrl.errors import ConfigError

#: the choices of ``env.python_sandbox``
KINDS = ("bubblewrap", "remote", "none")


@dataclass(frozen=True)
class SandboxSpec:
    """How the ``python`` tool runs code (the ``env.python_*`` settings); plain values only, so
    Ray can ship it to its workers.

    Args:
        kind: one of :data:`KINDS`.
        url: the service's ``run_code`` endpoint (``remote``; None otherwise).
        timeout: seconds of wall-clock and CPU time (a call made by
            :func:`~rlhf_torchrl.envs.tools.run_tool` stops at its own deadline if that comes first).
        memory_mb: address space of each process, in MB.
        max_processes: processes and threads at once.
        max_output_bytes: output read before the program is stopped.
        scratch_mb: size of the private ``/tmp`` (the working directory), in MB.
    """

    kind: str = "bubblewrap"
    url: str | None = None
    timeout: float = 10.0
    memory_mb: int = 512
    max_processes: int = 8
    max_output_bytes: int = 65536
    scratch_mb: int = 64


@dataclass
class Execution:
    """How running a program ended.

    Args:
        output: stdout and stderr as the program wrote them, at most ``max_output_bytes``.
        end: ``"exit"`` (it finished), ``"timeout"`` (stopped at the wall-clock limit),
            ``"output_limit"`` (stopped when it wrote more than the bound) or ``"error"`` (the
            sandbox itself failed; the code may not have run).
        returncode: with ``"exit"``, the exit status: negative for a signal, ``-9`` a kill at the
            CPU-time hard limit, ``-24`` the CPU-time soft limit (None: it did not exit).
        message: with ``"error"``, how the sandbox failed.
    """

    output: str
    end: str
    returncode: int | None = None
    message: str = ""


def make_sandbox(spec: SandboxSpec):
    """The sandbox ``spec.kind`` names, checked to work here: raises :class:`ConfigError` (one
    line: how to install bubblewrap, or how to opt out) where it cannot run code.

    Args:
        spec: the sandbox's kind and limits.
    """
    if spec.kind == "bubblewrap":
        from rlhf_torchrl.envs.sandbox.bubblewrap import BubblewrapSandbox

        sandbox = BubblewrapSandbox(spec)
        sandbox.check()
        return sandbox
    if spec.kind == "remote":
        from rlhf_torchrl.envs.sandbox.remote import RemoteSandbox

        return RemoteSandbox(spec)
    if spec.kind == "none":
        from rlhf_torchrl.envs.sandbox.process import UnsandboxedProcess

        return UnsandboxedProcess(spec)
    raise ConfigError(f"env.python_sandbox={spec.kind!r} is not one of {', '.join(KINDS)}: "
                      "bubblewrap (an operating-system sandbox, the default), remote (a sandbox "
                      "service at env.sandbox_url) or none (no isolation).")


__all__ = ["KINDS", "Execution", "SandboxSpec", "make_sandbox"]
