"""The python tool's sandbox, attacked as a policy would: each program below is one a policy could
write in a ``<tool name="python">`` call, sent through ``load_tools`` and ``run_tool`` as the
trainer sends it. The escapes (network, the trainer's environment, files and processes, limits
set by the call, a timed-out call's processes, a hung call holding the trainer, output floods,
fork bombs, user namespaces) all succeeded against the audit-hook sandbox this replaced; the
memory attacks (kernel objects, socket buffers, tmpfs inodes, /dev) held host memory that no limit
counted, before issue 46. Then the settings, ``env.python_sandbox=none`` and the remote executor,
against a real HTTP server."""

import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlhf_torchrl.envs.tools import ToolCall, describe_tools, load_tools, run_tool
from rlhf_torchrl.errors import ConfigError

# what switched the old sandbox off: its audit hook read its block list from the interpreter's
# __main__ module, which the policy's code reaches through sys.modules (a no-op here)
SWITCH_OFF = "import sys; sys.modules['__main__']._BLOCKED = ()\n"
# a trainer process (with its own environment) that runs one call from stdin
TRAINER = """
import sys
from rlhf_torchrl.envs.tools import ToolCall, load_tools, run_tool
print(run_tool(load_tools(["python"]), ToolCall("python", sys.stdin.read()), timeout=30).content)
"""


@pytest.fixture(scope="module")
def tools():
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    return load_tools(["python"])


def call(tools, code: str, timeout: float = 20.0):
    return run_tool(tools, ToolCall("python", code), timeout=timeout)


def processes_with(marker: str) -> list[int]:
    """The machine's processes whose command line holds ``marker``."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


# ---- escapes --------------------------------------------------------------------------------
@pytest.mark.parametrize("switch_off", ["", SWITCH_OFF], ids=["plain", "hook-switched-off"])
def test_no_network_not_even_the_trainers_machine(tools, switch_off):
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    code = switch_off + textwrap.dedent(f"""
        import socket
        socket.create_connection(("127.0.0.1", {port}), timeout=5).sendall(b"the reward's source")
        print("connected")""")
    result = call(tools, code)
    server.setblocking(False)
    with pytest.raises(BlockingIOError):  # a connection would be waiting here
        server.accept()[0].close()
    server.close()
    assert not result.ok and "connected" not in result.content, result.content
    assert "Address family not supported" in result.content, result.content  # no socket at all


def test_the_trainers_environment_is_out_of_reach():
    """A token in the trainer's environment: the code reads every /proc/<pid>/environ it can."""
    secret = f"hf_{uuid.uuid4().hex}"
    code = SWITCH_OFF + textwrap.dedent("""
        import os
        found = []
        for pid in [str(os.getppid())] + [p for p in os.listdir("/proc") if p.isdigit()]:
            try:
                found += [v for v in open(f"/proc/{pid}/environ").read().split("\\0") if "TOKEN" in v]
            except OSError:
                pass
        print(found)""")
    trainer = subprocess.run([sys.executable, "-c", TRAINER], input=code, capture_output=True,
                             text=True, env={**os.environ, "HF_TOKEN": secret}, timeout=300)
    assert trainer.returncode == 0, trainer.stderr
    assert secret not in trainer.stdout, trainer.stdout
    assert trainer.stdout.strip() == "[]", trainer.stdout  # it ran, and read no environment


def test_the_trainers_files_are_out_of_reach(tools, tmp_path):
    """Checkpoints, the reward's source, this repository, the interpreter's own packages: no
    reading, no rewriting, no deleting, no planting a .pth that runs at every start."""
    checkpoint, reward = tmp_path / "checkpoint.pt", tmp_path / "reward.py"
    checkpoint.write_bytes(b"weights")
    reward.write_text("def score(text):\n    return 0.0\n")
    planted = os.path.join(sysconfig.get_paths()["purelib"], f"rlhf_probe_{uuid.uuid4().hex}.pth")
    code = textwrap.dedent(f"""
        import os
        for path in [{str(checkpoint)!r}, {__file__!r}]:
            try:
                print("READ", open(path, "rb").read()[:40])
            except OSError as e:
                print(e)
        for action, path, text in [("REWROTE", {str(reward)!r}, "def score(text):\\n    return 1.0\\n"),
                                   ("PLANTED", {planted!r}, "# runs at every start\\n")]:
            try:
                open(path, "w").write(text)
                print(action)
            except OSError as e:
                print(e)
        try:
            os.remove({str(checkpoint)!r})
            print("DELETED")
        except OSError as e:
            print(e)""")
    try:
        result = call(tools, code)
    finally:
        if os.path.exists(planted):  # where the sandbox did not hold
            os.remove(planted)
    for word in ("READ", "REWROTE", "PLANTED", "DELETED"):
        assert word not in result.content, result.content
    assert result.content.count("No such file or directory") == 4, result.content  # not there
    assert "Read-only file system" in result.content, result.content  # the interpreter's own
    assert checkpoint.read_bytes() == b"weights" and "return 0.0" in reward.read_text()


def test_the_trainers_processes_are_out_of_reach(tools):
    code = SWITCH_OFF + textwrap.dedent(f"""
        import os
        try:
            os.kill({os.getpid()}, 0)
            print("the trainer is there")
        except OSError as e:
            print(e)
        print("uid", os.getuid(), [line for line in open("/proc/self/status") if line.startswith("CapEff")])""")
    result = call(tools, code)
    assert result.ok and "the trainer is there" not in result.content, result.content
    uid = int(re.search(r"uid (\d+)", result.content)[1])
    assert uid != 0 and r"CapEff:\t0000000000000000" in result.content, result.content


def test_the_code_cannot_make_a_user_namespace(tools):
    """Inside one it would be root: tmpfs mounts (memory outside its limit), more kernel surface."""
    code = SWITCH_OFF + textwrap.dedent("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        print("unshare:", libc.unshare(0x10000000), os.strerror(ctypes.get_errno()))""")
    result = call(tools, code)
    assert "unshare: -1" in result.content, result.content


@pytest.mark.parametrize("arguments, code", [
    ({"timeout": 600}, "import time; time.sleep(8); print('ran past its limit')"),
    ({"memory_mb": 65536}, "x = bytearray(2 * 2**30); print('allocated 2 GiB')"),
], ids=["timeout", "memory_mb"])
def test_a_call_cannot_set_its_own_limits(tools, arguments, code):
    """The limits are the config's: a call naming one is refused, as any unknown argument is."""
    result = run_tool(tools, ToolCall("python", {"code": code, **arguments}), timeout=3)
    assert not result.ok and "unexpected keyword argument" in result.content, result.content


def test_a_timed_out_call_leaves_no_process_behind(tools):
    """A grandchild in a session of its own, still sleeping when the call times out."""
    marker = f"rlhf-sandbox-test-{uuid.uuid4().hex}"
    code = SWITCH_OFF + textwrap.dedent(f"""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "{marker}"],
                         start_new_session=True)
        print("started", flush=True)
        time.sleep(60)""")
    result = call(tools, code, timeout=3)
    left = processes_with(marker)
    for pid in left:  # what the sandbox failed to stop
        os.kill(pid, signal.SIGKILL)
    assert not left
    assert "started" in result.content and "ran longer than 3 s" in result.content, result.content


def test_a_killed_trainer_leaves_no_sandbox_behind():
    marker = f"rlhf-sandbox-test-{uuid.uuid4().hex}"
    code = SWITCH_OFF + textwrap.dedent(f"""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "{marker}"])
        time.sleep(120)""")
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER], stdin=subprocess.PIPE, text=True)
    trainer.stdin.write(code)
    trainer.stdin.close()
    try:
        for _ in range(600):  # until the sandbox runs (the trainer imports torch first)
            if processes_with(marker) or trainer.poll() is not None:
                break
            time.sleep(0.2)
        assert processes_with(marker), "the sandbox never started"
    finally:
        trainer.kill()
        trainer.wait()
    for _ in range(100):  # SIGKILL travels bwrap's chain of parent-death signals
        if not processes_with(marker):
            break
        time.sleep(0.1)
    left = processes_with(marker)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left


def test_fifty_long_calls_leave_the_next_call_working(tools):
    with ThreadPoolExecutor(50) as pool:
        results = list(pool.map(lambda _: call(tools, "import time; time.sleep(60)", timeout=2),
                                range(50)))
    assert not any(result.ok for result in results)
    after = call(tools, "print(6 * 7)", timeout=10)
    assert after.ok and after.content == "42", after.content


def test_a_hung_tool_call_does_not_keep_the_trainer_from_exiting():
    script = textwrap.dedent("""
        import time
        from rlhf_torchrl.envs.tools import ToolCall, run_tool
        print(run_tool({"hang": lambda: time.sleep(600)}, ToolCall("hang", {}), timeout=0.5).content)""")
    try:
        trainer = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                 timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the trainer did not exit: its hung tool call's thread held it")
    assert trainer.returncode == 0 and "did not answer within 0.5 s" in trainer.stdout, trainer.stderr


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_an_output_flood_is_stopped_at_the_bound(tools, stream):
    code = f"import sys, time\nsys.{stream}.write('x' * 10_000_000)\nsys.{stream}.flush()\ntime.sleep(60)"
    result = call(tools, code)
    assert not result.ok and "printed more than 65536 bytes" in result.content, result.content[:200]


def test_a_fork_bomb_is_bounded_even_as_root(tools):
    """Bounded on purpose: against the old sandbox (switched off) it really forked, as root."""
    code = SWITCH_OFF + textwrap.dedent("""
        import os, time
        children = 0
        for _ in range(64):
            try:
                pid = os.fork()
            except OSError as e:
                print("refused:", e)
                break
            if pid == 0:
                time.sleep(3)
                os._exit(0)
            children += 1
        print("children:", children)""")
    result = call(tools, code)
    assert "Resource temporarily unavailable" in result.content, result.content
    assert int(re.search(r"children: (\d+)", result.content)[1]) < 8  # env.python_max_processes


def test_a_real_fork_bomb_ends_at_the_limit(tools):
    result = call(tools, "import os\nwhile True:\n    os.fork()", timeout=3)
    assert not result.ok
    assert call(tools, "print(6 * 7)").content == "42"


@pytest.mark.parametrize("code, says", [
    ("x = bytearray(8 * 2**30)", "MemoryError"),  # address space (RLIMIT_AS)
    ("import os\nfd = os.memfd_create('m')\nfor _ in range(1024):\n    os.write(fd, b'x' * 2**20)",
     "Operation not permitted"),  # memory outside the address space
    ("for i in range(200):\n    open(f'part{i}', 'wb').write(b'x' * 2**20)",
     "No space left on device"),  # the scratch folder
], ids=["address-space", "memfd", "scratch"])
def test_memory_is_bounded(tools, code, says):
    result = call(tools, code + "\nprint('allocated')")
    assert not result.ok and "allocated" not in result.content, result.content
    assert says in result.content, result.content


# ---- memory no limit counted ----------------------------------------------------------------
# Each of these held 0.2 to 1.5 GiB of the host's memory outside RLIMIT_AS (issue 46): kernel
# objects, socket buffers, tmpfs inodes, a writable /dev. Here each tries at most 64 MiB.
LIBC = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"


@pytest.fixture(params=["trainer", "not-root"])
def run_code(request, tools):
    """Runs code as the trainer's python tool does, and (as root) by the user-namespace path
    that a trainer which is not root takes; returns its output."""
    if request.param == "trainer":
        return lambda code: call(tools, code).content
    if os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"):
        pytest.skip("starts bwrap as nobody (needs root) with the system's Python")
    from rlhf_torchrl.envs.sandbox import SandboxSpec
    from rlhf_torchrl.envs.sandbox.bubblewrap import BubblewrapSandbox

    sandbox = BubblewrapSandbox(SandboxSpec(timeout=20.0), python="/usr/bin/python3", run_as=65534)
    return lambda code: sandbox.run(code).output


@pytest.mark.parametrize("make", [
    "libc.syscall(447, 0)",  # memfd_secret: +256 MiB of secret memory in 8 files, unmapped
    "libc.msgget(0, 0o1600)",  # System V message queues: +262 MiB of slab in 16384 queues
    "libc.semget(0, 32000, 0o1600)",  # System V semaphores: 2 MiB of slab per set of 32000
    "ctypes.CDLL('librt.so.1', use_errno=True).mq_open(b'/q', 0o102, 0o600, None)",
    "libc.inotify_init1(0)",  # 198k watches: +18 MiB of slab
    "libc.timer_create(1, None, ctypes.byref(ctypes.c_void_p()))",  # 96k timers: +36 MiB
], ids=["memfd_secret", "msgget", "semget", "mq_open", "inotify", "timer_create"])
def test_kernel_objects_outside_the_limits_are_refused(run_code, make):
    output = run_code(LIBC + f"made = {make}\n"
                      "print('made:', made, os.strerror(ctypes.get_errno()) if made < 0 else '')")
    assert "made: -1 Operation not permitted" in output, output


def test_socket_and_pipe_buffers_are_bounded(run_code):
    """No network socket (TCP over the sandbox's loopback held 256 MiB in 69 connections), no
    buffer raised past the default, and one process's unix sockets hold what its descriptors
    allow (256 MiB in 17 socket pairs before)."""
    code = textwrap.dedent("""
        import fcntl, os, socket
        for family in (socket.AF_INET, socket.AF_INET6):
            try:
                socket.socket(family)
                print("made a socket of", family)
            except OSError as e:
                print(e)
        a, b = socket.socketpair()
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                a.setsockopt(socket.SOL_SOCKET, option, 2**26)
                print("raised a socket's buffer")
            except OSError as e:
                print(e)
        r, w = os.pipe()
        try:
            fcntl.fcntl(w, 1031, 2**20)  # F_SETPIPE_SZ
            print("raised a pipe's buffer")
        except OSError as e:
            print(e)
        pairs, queued = [], 0
        try:
            while queued < 64 * 2**20:
                pairs.append(socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM))
                for end in pairs[-1]:
                    end.setblocking(False)
                    try:
                        while queued < 64 * 2**20:
                            queued += end.send(b"x" * 65536)
                    except BlockingIOError:
                        pass
        except OSError as e:
            print(e)
        print("queued MiB:", queued >> 20)""")
    output = run_code(code)
    assert "made a" not in output and "raised" not in output, output
    assert output.count("Address family not supported by protocol") == 2, output
    assert output.count("Operation not permitted") == 3, output
    assert "Too many open files" in output and int(re.search(r"queued MiB: (\d+)", output)[1]) < 32


def test_tmpfs_inodes_are_bounded(run_code):
    """Empty files take no space but a kernel inode each: 200k of them held +199 MiB of slab."""
    code = textwrap.dedent("""
        for folder in ("/tmp", "/dev/shm"):
            made = 0
            try:
                while made < 20_000:
                    open(f"{folder}/f{made}", "w").close()
                    made += 1
            except OSError as e:
                print(folder, e.strerror)
            print(folder, "files:", made)""")
    output = run_code(code)
    for folder in ("/tmp", "/dev/shm"):  # inode_limit(): 4096 for the default 64 MB of scratch
        assert f"{folder} No space left on device" in output, output
        assert int(re.search(rf"{folder} files: (\d+)", output)[1]) < 4096, output


def test_dev_is_read_only_and_dev_shm_is_small(run_code):
    """/dev was a writable tmpfs of half the host's memory in a user namespace (256 MiB written
    in 32 MiB files); as root /dev/shm was not writable at all (multiprocessing's locks failed)."""
    code = textwrap.dedent("""
        try:
            open("/dev/x", "wb").write(b"x" * 2**20)
            print("wrote /dev")
        except OSError as e:
            print("/dev:", e.strerror)
        written = 0
        try:
            for i in range(8):  # 8 MiB files: RLIMIT_FSIZE is per file
                with open(f"/dev/shm/x{i}", "wb") as f:
                    for _ in range(8):
                        f.write(b"x" * 2**20)
                        written += 1
        except OSError as e:
            print("/dev/shm:", e.strerror)
        print("/dev/shm MiB:", written)""")
    output = run_code(code)
    assert "/dev: Read-only file system" in output, output
    assert "/dev/shm: No space left on device" in output, output
    assert int(re.search(r"/dev/shm MiB: (\d+)", output)[1]) <= 16, output


def test_python_programs_still_run(run_code):
    """What the seccomp filter and the new /dev must leave alone: subprocesses, multiprocessing
    (its locks are files in /dev/shm), asyncio (a unix socket pair), threads, temporary files."""
    code = textwrap.dedent("""
        import asyncio, multiprocessing, subprocess, sys, tempfile, threading

        async def answer():
            await asyncio.sleep(0.01)
            return 42

        if __name__ == "__main__":
            print("asyncio", asyncio.run(answer()))
            with multiprocessing.Pool(2) as pool:
                print("pool", pool.map(abs, [-1, -2]))
            with multiprocessing.Lock():
                print("lock")
            print("subprocess", subprocess.run([sys.executable, "-c", "print(7)"],
                                               capture_output=True, text=True).stdout.strip())
            thread = threading.Thread(target=print, args=("thread",))
            thread.start()
            thread.join()
            with tempfile.NamedTemporaryFile() as f:
                print("tempfile", f.name.startswith("/tmp/"))""")
    output = run_code(code)
    for line in ("asyncio 42", "pool [1, 2]", "lock", "subprocess 7", "thread", "tempfile True"):
        assert line in output.splitlines(), output


def test_the_code_holds_no_capability(run_code):
    """The prelude holds CAP_SYS_ADMIN to set its mounts' inode limits; the code must not."""
    code = LIBC + textwrap.dedent("""
        print("".join(line for line in open("/proc/self/status") if line.startswith("Cap")))
        print("mount:", libc.mount(None, b"/tmp", None, 0x26, b"nr_inodes=1000000"),
              os.strerror(ctypes.get_errno()))""")
    output = run_code(code)
    assert "mount: -1 Operation not permitted" in output, output
    for name in ("CapPrm", "CapEff", "CapAmb"):
        assert f"{name}:\t0000000000000000" in output, output


def run_filter(program: bytes, arch: int, nr: int, *args: int) -> int:
    """What a classic-BPF seccomp ``program`` returns for one call (the kernel's reading of it)."""
    data = struct.pack("=iI8x6Q", nr, arch, *args, *[0] * (6 - len(args)))
    instructions = [struct.unpack("=HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]
    pc, accumulator = 0, 0
    while True:
        code, jt, jf, k = instructions[pc]
        if code == 0x20:  # BPF_LD|BPF_W|BPF_ABS
            accumulator = struct.unpack_from("=I", data, k)[0]
        elif code == 0x06:  # BPF_RET|BPF_K
            return k
        else:
            taken = {0x15: accumulator == k, 0x35: accumulator >= k, 0x45: accumulator & k}[code]
            pc += jt if taken else jf
        pc += 1


@pytest.mark.parametrize("machine, arch, numbers", [
    ("x86_64", 0xC000003E, {"read": 0, "memfd_secret": 447, "msgget": 68, "socket": 41,
                            "setsockopt": 54, "fcntl": 72, "clone": 56, "clone3": 435}),
    ("aarch64", 0xC00000B7, {"read": 63, "memfd_secret": 447, "msgget": 186, "socket": 198,
                             "setsockopt": 208, "fcntl": 25, "clone": 220, "clone3": 435}),
])
def test_the_seccomp_filter_decides_alike_on_both_architectures(machine, arch, numbers):
    """aarch64's program cannot run here: each decision, read as the kernel reads the program."""
    from rlhf_torchrl.envs.sandbox.seccomp import seccomp_filter

    program = seccomp_filter(machine)
    allow, eperm, enosys, eafnosupport = 0x7FFF0000, 0x50001, 0x50026, 0x50061

    def decide(name, *args):
        return run_filter(program, arch, numbers[name], *args)

    assert decide("read", 0) == allow and run_filter(program, 0x40000003, 3) == eperm  # i386
    assert decide("memfd_secret") == eperm and decide("msgget") == eperm
    assert decide("socket", 1) == allow and decide("socket", 2) == decide("socket", 10) == eafnosupport
    assert decide("setsockopt", 3, 1, 7) == decide("setsockopt", 3, 1, 8) == eperm  # SO_SNDBUF
    assert decide("setsockopt", 3, 1, 2) == decide("setsockopt", 3, 6, 7) == allow  # SO_REUSEADDR
    assert decide("fcntl", 3, 1031) == eperm and decide("fcntl", 3, 3) == allow  # F_GETFL
    assert decide("clone", 0x10000000) == eperm and decide("clone", 0x01200011) == allow  # fork
    assert decide("clone3") == enosys
    assert seccomp_filter("riscv64") is None


def test_a_call_gets_a_cgroup_where_one_can_be_made(tools):
    """With cgroup v2's memory controller delegated: each call in a cgroup of its own whose
    memory.max counts tmpfs pages too; past it the whole call is killed, not the trainer."""
    from rlhf_torchrl.envs.sandbox import SandboxSpec
    from rlhf_torchrl.envs.sandbox.bubblewrap import SHM_MB, BubblewrapSandbox
    from rlhf_torchrl.envs.sandbox.cgroup import call_parent

    parent, why = call_parent()
    if parent is None:
        pytest.skip(f"no cgroup per call here: {why}")
    sandbox = BubblewrapSandbox(SandboxSpec(timeout=20.0, memory_mb=128, max_processes=1))
    assert sandbox.memory_max() == (128 + 64 + SHM_MB) * 2**20
    seen = []
    watching = threading.Event()

    def watch():  # the call's cgroup, from outside, while it runs
        while not watching.is_set():
            for name in os.listdir(parent):
                if name.startswith(f"rlhf-call-{os.getpid()}-"):
                    try:
                        with open(os.path.join(parent, name, "memory.max")) as f:
                            seen.append(int(f.read()))
                    except OSError:
                        pass
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        run = sandbox.run("import time; open('/tmp/x', 'wb').write(b'x' * 2**20); time.sleep(1)")
    finally:
        watching.set()
        watcher.join()
    assert run.end == "exit" and run.returncode == 0, run.output
    assert seen and set(seen) == {sandbox.memory_max()}
    assert not [name for name in os.listdir(parent) if name.startswith(f"rlhf-call-{os.getpid()}-")]
    # tmpfs pages are counted: 60 MiB in /tmp, 15 in /dev/shm and 100 of bytearray pass 150 MiB
    small = BubblewrapSandbox(SandboxSpec(timeout=20.0, memory_mb=256, max_processes=1))
    small.memory_max = lambda: 150 * 2**20
    code = textwrap.dedent("""
        for folder, size in (("/tmp", 60), ("/dev/shm", 15)):
            with open(f"{folder}/fill", "wb") as f:
                for _ in range(size):
                    f.write(b"x" * 2**20)
        x = bytearray(100 * 2**20)
        print("held it all")""")
    killed = small.run(code)
    assert "held it all" not in killed.output and killed.returncode == -9, killed
    assert call(tools, "print(6 * 7)").content == "42"


# ---- the tool and its settings --------------------------------------------------------------
def test_the_policy_sees_a_tool_of_one_argument(tools):
    assert "- python(code): Run Python code in a sandbox" in describe_tools(tools)


def test_the_sandbox_settings_reach_the_tool_and_the_collector(tmp_path):
    from rlhf_torchrl.config import compose
    from rlhf_torchrl.config.builders import check_config, collector_spec, make_tools
    from rlhf_torchrl.envs.sandbox import SandboxSpec

    cfg = compose([f"output_dir={tmp_path}", "data.chat_template=null", "env.max_turns=2",
                   "env.tools=[calculator,python]",
                   "env.tool_timeout=7", "env.python_memory_mb=256", "env.python_max_processes=4",
                   "env.python_max_output_bytes=1000", "env.python_scratch_mb=16"])
    check_config(cfg)
    expected = SandboxSpec("bubblewrap", None, timeout=7.0, memory_mb=256, max_processes=4,
                           max_output_bytes=1000, scratch_mb=16)
    assert make_tools(cfg)["python"].spec == expected
    assert collector_spec(cfg, [0]).python_sandbox == expected
    assert make_tools(cfg)["python"]("print(6 * 7)").content == "42"


def test_no_sandbox_installed_is_one_line_before_any_model(monkeypatch, tmp_path):
    from rlhf_torchrl.config import compose
    from rlhf_torchrl.config.builders import make_tools

    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    cfg = compose([f"output_dir={tmp_path}", "data.chat_template=null", "env.max_turns=2",
                   "env.tools=[calculator,python]"])
    with pytest.raises(ConfigError, match=r"bwrap is not installed.*apt-get install bubblewrap.*"
                       r"env.python_sandbox=remote.*env.python_sandbox=none") as error:
        make_tools(cfg)
    assert "\n" not in str(error.value)
    assert list(load_tools(["calculator"])) == ["calculator"]  # tools that run no code: unaffected


def test_a_bad_sandbox_setting_is_one_line(tmp_path):
    from rlhf_torchrl.config import compose
    from rlhf_torchrl.config.builders import check_config, make_tools

    with pytest.raises(ConfigError, match=r"env.python_sandbox='docker' is not one of .*bubblewrap"):
        check_config(compose([f"output_dir={tmp_path}", "env.python_sandbox=docker"]))
    cfg = compose([f"output_dir={tmp_path}", "data.chat_template=null", "env.max_turns=2",
                   "env.tools=[python]",
                   "env.python_sandbox=remote"])
    with pytest.raises(ConfigError, match=r"env.python_sandbox=remote needs .* set env.sandbox_url"):
        make_tools(cfg)


def test_no_sandbox_is_an_explicit_choice_with_a_warning(caplog, monkeypatch):
    from rlhf_torchrl.envs.sandbox import SandboxSpec
    from rlhf_torchrl.envs.sandbox.process import UnsandboxedProcess

    monkeypatch.setattr(UnsandboxedProcess, "_warned", False)  # once per process: this one's
    with caplog.at_level("WARNING"):
        tools = load_tools(["python"], python_sandbox=SandboxSpec(kind="none", timeout=5.0))
    assert "WITHOUT a sandbox" in caplog.text
    assert call(tools, "print(6 * 7)").content == "42"
    refused = run_tool(tools, ToolCall("python", {"code": "print(1)", "timeout": 60}))
    assert not refused.ok and "unexpected keyword argument 'timeout'" in refused.content


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"),
                    reason="starts bwrap as nobody (needs root) with the system's Python")
def test_a_trainer_that_is_not_root_gets_the_same_limits():
    """The user-namespace path: bwrap started as nobody, the sandbox's user mapped to it."""
    from rlhf_torchrl.envs.sandbox import SandboxSpec
    from rlhf_torchrl.envs.sandbox.bubblewrap import BubblewrapSandbox

    sandbox = BubblewrapSandbox(SandboxSpec(timeout=10.0), python="/usr/bin/python3", run_as=65534)
    sandbox.check()
    code = textwrap.dedent("""
        import ctypes, os, socket, time
        for _ in range(64):
            try:
                if os.fork() == 0:
                    time.sleep(3)
                    os._exit(0)
            except OSError as e:
                print("refused:", e)
                break
        try:
            socket.create_connection(("1.1.1.1", 53), timeout=3)
        except OSError as e:
            print("network:", e)
        print("unshare:", ctypes.CDLL(None).unshare(0x10000000))""")
    run = sandbox.run(code)
    assert "refused: [Errno 11]" in run.output and "network: [Errno 97]" in run.output, run.output
    assert "unshare: -1" in run.output


# ---- the remote executor, against a real service on localhost --------------------------------
class RunCode(BaseHTTPRequestHandler):
    """A SandboxFusion-like service: ``POST /run_code``, run by this package's bubblewrap
    sandbox with the request's limits; the first ``server.failures`` requests get a 503."""

    def do_POST(self):  # noqa: N802 - http.server's name
        from rlhf_torchrl.envs.sandbox import SandboxSpec
        from rlhf_torchrl.envs.sandbox.bubblewrap import BubblewrapSandbox

        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(request)
        if self.server.failures > 0:
            self.server.failures -= 1
            self.send_error(503, "warming up")
            return
        run = BubblewrapSandbox(SandboxSpec(timeout=request["run_timeout"],
                                            memory_mb=request["memory_limit_MB"])).run(request["code"])
        finished = {"exit": "Finished", "timeout": "TimeLimitExceeded"}.get(run.end, "Error")
        answer = json.dumps({
            "status": "Success" if finished == "Finished" and run.returncode == 0 else "Failed",
            "message": "", "compile_result": None, "files": {},
            "run_result": {"status": finished, "execution_time": 0.1, "return_code": run.returncode,
                           "stdout": run.output, "stderr": ""}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


@pytest.fixture
def service(tools):
    server = ThreadingHTTPServer(("127.0.0.1", 0), RunCode)
    server.requests, server.failures = [], 0
    threading.Thread(target=server.serve_forever, daemon=True).start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}/run_code"
    yield server
    server.shutdown()
    server.server_close()


def remote_tools(url: str, **limits):
    from rlhf_torchrl.envs.sandbox import SandboxSpec

    return load_tools(["python"], python_sandbox=SandboxSpec(kind="remote", url=url, **limits))


def test_remote_runs_the_code_with_the_configs_limits(service):
    tools = remote_tools(service.url, timeout=8.0, memory_mb=256)
    assert call(tools, "print(6 * 7)", timeout=5).content == "42"
    request = service.requests[-1]
    assert (request["code"], request["language"], request["memory_limit_MB"]) == ("print(6 * 7)", "python", 256)
    assert 0 < request["run_timeout"] <= 5  # run_tool's deadline, sooner than the setting
    stopped = call(tools, "import time; time.sleep(30)", timeout=2)
    assert not stopped.ok and "ran longer than" in stopped.content, stopped.content
    failed = call(tools, "raise ValueError('no')")
    assert not failed.ok and "ValueError: no" in failed.content


def test_remote_retries_a_busy_service(service):
    service.failures = 2
    result = call(remote_tools(service.url, timeout=10.0), "print('third time')")
    assert result.content == "third time" and len(service.requests) == 3


def test_remote_down_is_a_clear_tool_message(caplog):
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]  # nothing listens there once closed
    tools = remote_tools(f"http://127.0.0.1:{port}/run_code", timeout=10.0)
    with caplog.at_level("WARNING"):
        result = call(tools, "print(1)")
    assert not result.ok and "did not answer (3 attempts" in result.content, result.content
    assert "could not run" in result.content and "did not answer" in caplog.text
