"""reuse_freed_memory: freed large tensors are reused without new page faults (in a subprocess)."""

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


def _spinner(nice: int = 0) -> subprocess.Popen:
    cmd = [sys.executable, "-c", "while True: pass"]
    return subprocess.Popen(["nice", "-n", str(nice), *cmd] if nice else cmd)


@pytest.mark.skipif(not os.path.exists("/proc/stat") or len(os.sched_getaffinity(0)) < 2,
                    reason="reads /proc/stat; needs 2 cores to have one to give up")
def test_thread_tuner_gives_a_busy_core_back():
    """A normal-priority busy process takes a core: one thread fewer. A niced one yields: all."""
    import time

    import torch

    from rlhf_torchrl.runtime import ThreadTuner

    threads = torch.get_num_threads()
    tuner = ThreadTuner(max_threads=len(os.sched_getaffinity(0)))
    try:
        time.sleep(0.5)
        baseline = tuner.others_busy()
        for nice, expect_busy in ((0, True), (19, False)):
            spinner = _spinner(nice)
            try:
                time.sleep(0.3)
                tuner.others_busy()  # start measuring once the spinner runs
                time.sleep(1.0)
                busy = tuner.others_busy()
            finally:
                spinner.kill()
                spinner.wait()
            if expect_busy:
                assert busy > baseline + 0.7, (busy, baseline)
            else:
                assert busy < baseline + 0.3, (busy, baseline)
        spinner = _spinner()
        try:
            time.sleep(0.3)
            tuner.others_busy()
            time.sleep(1.0)
            assert tuner.update() == tuner.max_threads - 1 == torch.get_num_threads()
        finally:
            spinner.kill()
            spinner.wait()
        assert ThreadTuner(max_threads=2, adapt=False).update() == 2
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
    from rlhf_torchrl.config import builders, compose

    monkeypatch.setattr(builders, "native_bf16", lambda device: native)

    def resolved(*overrides):
        cfg = compose(["model.autocast=auto", *overrides])
        builders.resolve_precision(cfg)
        builders.resolve_precision(cfg)  # idempotent: the second call sees the resolved value
        return cfg.model.autocast, cfg.ppo.tis_cap

    assert resolved() == (("bfloat16", builders.AUTO_TIS_CAP) if native else (None, None))
    assert resolved("ppo.tis_cap=1.5") == ("bfloat16" if native else None, 1.5)
    assert resolved("model.dtype=bfloat16") == (None, None)  # already low precision: no autocast
    # log-probs recorded while sampling, as asked: nothing to correct, no TIS
    assert resolved("generation.log_probs_from_sampling=true") == ("bfloat16" if native else None, None)
    assert resolved("model.autocast=null") == (None, None)
    assert resolved("model.autocast=float16") == ("float16", None)
