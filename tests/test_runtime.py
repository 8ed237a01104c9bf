"""reuse_freed_memory: freed large tensors are reused without new page faults (in a subprocess);
the thread tuner on fixed /proc/stat contents; devices and precision."""

import os
import subprocess
import sys

import pytest

PROBE = """
import resource, sys, torch
from rlhf_torchrl.runtime import reuse_freed_memory
applied = reuse_freed_memory() if sys.argv[1] == "on" else False
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.ones(64, 1 << 20).sum()  # 256 MB once, so the heap has grown before counting
before = faults()
for _ in range(5):
    torch.ones(16, 1 << 20).sum()  # 64 MB, written then freed
print(applied, faults() - before)
"""


def _run(mode: str) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_reuse_freed_memory_avoids_page_faults():
    applied, faults_on = _run("on")
    _, faults_off = _run("off")
    if not applied:
        pytest.skip("the C library is not glibc")
    pages = 5 * (64 << 20) // 4096  # one fault per 4 KB page when every allocation is fresh
    assert faults_off > pages // 2, faults_off
    assert faults_on < pages // 20, faults_on


def _write_stat(path, ticks: dict[int, tuple[int, int, int, int]]) -> None:
    """A ``/proc/stat`` with each core's (user, nice, system, idle) ticks (iowait, irq, softirq,
    steal: 0), the all-cores line first and other counters after, as Linux writes it."""
    total = [sum(t[i] for t in ticks.values()) for i in range(4)]
    lines = ["cpu  " + " ".join(map(str, [*total, 0, 0, 0, 0, 0, 0]))]
    lines += [f"cpu{k} " + " ".join(map(str, [*t, 0, 0, 0, 0, 0, 0])) for k, t in ticks.items()]
    path.write_text("\n".join([*lines, "intr 12345 0 0", "ctxt 999", "processes 42"]) + "\n")


def test_thread_tuner_gives_a_busy_core_back(tmp_path):
    """Fixed /proc/stat contents 1 s apart on 4 cores: this process keeps core 0 busy; another
    normal-priority process on core 1 takes it (one thread fewer), a niced one yields it (all 4
    threads); core 4, outside the affinity set, is not counted."""
    import torch

    from rlhf_torchrl.runtime import ThreadTuner

    hz = os.sysconf("SC_CLK_TCK")
    idle, user, nice = (1000, 1000, 1000, 1000 + hz), (1000 + hz, 1000, 1000, 1000), (1000, 1000 + hz, 1000, 1000)
    stat, cpu_seconds = tmp_path / "stat", [10.0]  # this process's CPU time

    def tuner_after(core_1) -> ThreadTuner:
        _write_stat(stat, {k: (1000, 1000, 1000, 1000) for k in range(5)})
        cpu_seconds[0] = 10.0
        tuner = ThreadTuner(max_threads=4, stat=str(stat), cpus={0, 1, 2, 3},
                            cpu_time=lambda: cpu_seconds[0])
        _write_stat(stat, {0: user, 1: core_1, 2: idle, 3: idle, 4: user})
        cpu_seconds[0] = 11.0  # core 0's second of user time is ours
        return tuner

    threads = torch.get_num_threads()
    try:
        for core_1, busy, expected_threads in ((user, 1.0, 3), (nice, 0.0, 4), (idle, 0.0, 4)):
            tuner = tuner_after(core_1)
            assert tuner.others_busy() == pytest.approx(busy)
            assert tuner.others_busy() is None  # no tick since: no measurement
            assert tuner_after(core_1).update() == expected_threads == torch.get_num_threads()
        missing = ThreadTuner(max_threads=3, stat=str(tmp_path / "none"), cpus={0, 1})
        assert missing.others_busy() is None and missing.update() == 3  # no /proc/stat: all
        assert ThreadTuner(max_threads=2, adapt=False, stat=str(stat)).update() == 2
    finally:
        torch.set_num_threads(threads)


def test_resolve_device_and_placed():
    import torch

    from rlhf_torchrl.runtime import placed, resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="not a device"):
        resolve_device("abacus")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")
    module = torch.nn.Linear(2, 2)
    moves = []
    module.register_forward_pre_hook(lambda *_: moves.append(module.weight.device.type))
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    with placed(module, device, offload=True):
        module(torch.zeros(1, 2, device=device))  # on the device for the block
    assert moves == [device.type] and module.weight.device.type == "cpu"  # back on the CPU after
    with placed(module, device, offload=False) as same:
        assert same is module and module.weight.device.type == "cpu"  # not offloaded: left alone


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/cpuinfo")
def test_native_bf16_reads_the_cpu_flags():
    import torch

    from rlhf_torchrl.runtime import native_bf16

    with open("/proc/cpuinfo") as f:
        flags = set(next(line for line in f if line.startswith("flags")).split())
    assert native_bf16(torch.device("cpu")) == bool({"avx512_bf16", "amx_tile"} & flags)
    assert not native_bf16(torch.device("meta"))


@pytest.mark.parametrize("native", [True, False], ids=["native-bf16", "emulated-bf16"])
def test_autocast_auto_resolves_into_the_config(monkeypatch, native):
    """``model.autocast=auto`` becomes bfloat16 (and ``ppo.tis_cap`` 2 when null) where the device
    computes bf16 natively and the weights are fp32, else null; explicit settings stay."""
    from rlhf_torchrl.config import builders, compose, derived

    monkeypatch.setattr(derived, "native_bf16", lambda device: native)

    def resolved(*overrides):
        cfg = compose(["model.autocast=auto", *overrides])
        builders.resolve_precision(cfg)
        builders.resolve_precision(cfg)  # idempotent: the second call sees the resolved value
        return cfg.model.autocast, cfg.ppo.tis_cap

    assert resolved() == (("bfloat16", derived.AUTO_TIS_CAP) if native else (None, None))
    assert resolved("ppo.tis_cap=1.5") == ("bfloat16" if native else None, 1.5)
    # already low precision: no autocast, and the old log-probs recomputed: TIS (derived.tis_cap)
    assert resolved("model.dtype=bfloat16") == (None, derived.AUTO_TIS_CAP)
    # log-probs recorded while sampling, as asked: nothing to correct, no TIS
    assert resolved("generation.log_probs_from_sampling=true") == ("bfloat16" if native else None, None)
    assert resolved("model.autocast=null") == (None, None)
    assert resolved("model.autocast=float16") == ("float16", derived.AUTO_TIS_CAP)  # fp16: TIS too
