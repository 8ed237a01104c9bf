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
