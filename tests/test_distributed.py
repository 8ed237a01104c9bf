"""torchrun with 2 processes (gloo) against one process on the same global batch: DDP and FSDP2.

A run is world-size invariant: every row is sampled from its own stream, the global batch is
gathered before the KL rewards, GAE and metrics, and each minibatch's gradient is the token-mean
over all its rows whichever process ran them. So the per-iteration metrics and the final weights
of 1 and 2 processes agree up to float rounding.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf_torchrl.benchmarks.common import kill_tree, process_tree, run_bounded

ROOT = Path(__file__).resolve().parents[1]
TINY = ["ppo.num_iterations=2", "ppo.batch_size=8", "ppo.num_mini_batches=2",
        "ppo.forward_batch_size=4", "generation.max_new_tokens=6", "logging.progress_bar=false",
        "data.limit=32", "optim.lr=1e-3", "threads=1", "logging.logger=null",
        "eval.every=0", "optim.critic_warmup=0", "model.autocast=null"]  # fp32 whatever the default
IGNORED = {"threads", "iteration"}  # and every time/* entry

pytestmark = [pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not installed"),
              pytest.mark.xdist_group("serial"),  # under pytest -n: one worker, one at a time
              pytest.mark.processes]  # the suite of its own (pyproject.toml's markers)


def _run(out: Path, model_dir: str, nproc: int, *overrides: str, device: str = "cpu",
         torchrun: bool | None = None) -> list[dict]:
    """The recipe in ``nproc`` processes (torchrun unless ``nproc`` is 1; ``torchrun=True``: one
    process under torchrun too)."""
    launcher = ([sys.executable, str(ROOT / "recipes" / "ppo.py")]
                if not (torchrun if torchrun is not None else nproc > 1) else
                ["torchrun", "--standalone", f"--nproc_per_node={nproc}", str(ROOT / "recipes" / "ppo.py")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    # past its deadline the job is killed with its workers (sessions of their own under torchrun)
    proc = run_bounded([*launcher, f"model.policy={model_dir}", f"output_dir={out}",
                        f"hydra.run.dir={out}", f"device={device}", *TINY, *overrides],
                       timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "policy" / "model.safetensors")


CASES = {
    # micro-batches by token budget: each process runs as many as the busiest needs
    "ddp-critic-token-budget": ["distributed.strategy=ddp", "value_model.init=policy",
                                "ppo.micro_batch_tokens=40"],
    # the background sampler runs the sharded policy (overlap=0): its forwards and the sharded
    # checkpoints, both collectives, never interleave (AsyncCollector.paused)
    "fsdp2-critic-overlap-0": ["distributed.strategy=fsdp2", "value_model.init=policy",
                               "collection.overlap=0", "checkpoint.every=1"],
    # gradients kept local until the last micro-batch of a minibatch; on stopping_llama_dir, whose
    # responses stop at different steps from row to row: every forward is a collective, so a
    # process whose rows have all stopped keeps stepping (synced_gpus) until the other's have;
    # distributed.balance=auto balances the rows here (several padded micro-batches a process)
    "fsdp2-shared-accumulation-stopping": ["distributed.strategy=fsdp2", "value_model.init=shared",
                                           "ppo.gradient_accumulation_steps=2",
                                           "generation.max_new_tokens=8"],
    # groups of 2 responses stay on one process; the groups with equal scores are dropped after the
    # gather (half of them here), so 4 minibatches of 1 row each go to one process, the other
    # runs an empty slice
    "ddp-rloo-groups-filtered": ["distributed.strategy=ddp", "advantage.estimator=rloo",
                                 "generation.samples_per_prompt=2", "ppo.kl_loss_coef=0.01",
                                 "advantage.filter_groups=true", "ppo.num_mini_batches=4"],
    # episodes of up to 3 turns with the calculator (the taught tiny Llama), in groups of 2 per
    # question: rows of one process end at other turns than the other's; the observation masks
    # are gathered with the rows. 31 tokens an episode: a call (15) and the tool's message (11)
    # leave the answer 5, so it is cut at its own budget, before its period (30 would cut the
    # number too: no score, nothing learned; rows with budgets that differ within a batch:
    # tests/test_multiturn.py). The critic shares the policy's trunk
    "ddp-shared-critic-multi-turn": ["distributed.strategy=ddp", "value_model.init=shared",
                                     "env.max_turns=3", "env.tools=[calculator]",
                                     "env.describe_tools=false", "data.system_prompt=null",
                                     "data.chat_template=null",
                                     "generation.max_new_tokens=16", "generation.samples_per_prompt=2",
                                     "env.max_tokens=31"],
    # distributed.balance: each minibatch's rows split over the processes by real tokens (sets of
    # any size under a token budget, so as many micro-batches as the busiest process's), on
    # responses that stop at varied steps
    "fsdp2-critic-balanced-token-budget-stopping": ["distributed.strategy=fsdp2",
                                                    "distributed.balance=true",
                                                    "value_model.init=policy",
                                                    "ppo.micro_batch_tokens=40",
                                                    "generation.max_new_tokens=8"],
}
#: the model of the cases that need their own (the others: tiny_llama_dir)
MODELS = {"fsdp2-shared-accumulation-stopping": "stopping_llama_dir",
          "ddp-shared-critic-multi-turn": "tool_llama_dir",
          "fsdp2-critic-balanced-token-budget-stopping": "stopping_llama_dir"}


@pytest.mark.parametrize("case", CASES)
def test_two_processes_match_one(tmp_path, request, case):
    overrides = CASES[case]
    model_dir = request.getfixturevalue(MODELS.get(case, "tiny_llama_dir"))
    if "env.max_turns=3" in overrides:  # questions the tool Llama answers with a call, or without
        from conftest import PLAIN_QUESTION, TOOL_QUESTION

        data = tmp_path / "questions.jsonl"
        data.write_text("".join(json.dumps({"prompt": q, "answer": "5"}) + "\n"
                                for q in [TOOL_QUESTION, PLAIN_QUESTION] * 16))
        overrides = [*overrides, f"data.source={data}", "data.template=null", "data.max_words=null",
                     "reward.functions=[rlhf_torchrl.rewards.functions.gsm8k_correct]"]
    one = _run(tmp_path / "one", model_dir, 1, *overrides)
    two = _run(tmp_path / "two", model_dir, 2, *overrides)
    # only rank 0 writes: one line per iteration, not one per process
    assert [m["iteration"] for m in two] == [m["iteration"] for m in one] == [0, 1]
    compared = 0
    for a, b in zip(one, two):
        assert a.keys() == b.keys()
        for key, value in a.items():
            if key in IGNORED or key.startswith("time/"):
                continue
            # a clip fraction counts tokens: one on the clip boundary, put on the other side by
            # float rounding, moves it by 1/(2n) (2 minibatches of n <= 24 valid tokens, averaged)
            tolerance = 0.1 if "clipfrac" in key else 1e-5
            assert b[key] == pytest.approx(value, rel=1e-4, abs=tolerance), (a["iteration"], key)
            compared += 1
    assert compared > 2 * 20
    if "advantage.filter_groups=true" in overrides:  # groups were dropped: uneven slices ran
        assert any(m["group/filtered_frac"] > 0 for m in one)
    if "env.max_turns=3" in overrides:  # some episodes called the tool, some did not
        assert any(1 < m["env/turns_per_episode"] < 2 for m in one)
        assert any(m["env/end_max_tokens"] > 0 for m in one)  # and some ran out of tokens
    if MODELS.get(case) == "stopping_llama_dir":  # responses stopped early, at varied steps
        lengths = [m["val/sequence_lengths"] for m in one]
        assert all(1 < n < 8 for n in lengths), lengths
    if "distributed.balance=true" in overrides:  # the processes took balanced sets of rows
        logged = "".join(f.read_text() for f in (tmp_path / "two").glob("*.log"))
        assert "update rows balanced by tokens" in logged
    # the run learned something (the comparison is not between two untouched models)
    assert one[-1]["objective/kl"] != 0.0 and one[-1]["loss/policy_avg"] != 0.0
    w1, w2 = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    assert w1.keys() == w2.keys()  # a full Hugging Face checkpoint, tied weights saved once
    for key in w1:
        torch.testing.assert_close(w2[key], w1[key], atol=1e-5, rtol=1e-4)
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == sorted(
        p.name for p in (tmp_path / "one").iterdir())


def test_fsdp2_in_one_process_matches_the_plain_run(tmp_path, tiny_llama_dir):
    """torchrun with one process and distributed.strategy=fsdp2 shards every model over a mesh of
    one (FSDP2's engine on a single GPU, as bench real_sizes runs it): the same metrics and weights
    as the run without torchrun."""
    overrides = ["distributed.strategy=fsdp2", "value_model.init=policy"]
    plain = _run(tmp_path / "plain", tiny_llama_dir, 1, *overrides)
    sharded = _run(tmp_path / "sharded", tiny_llama_dir, 1, *overrides, torchrun=True)
    logged = "".join(f.read_text() for f in (tmp_path / "sharded").glob("*.log"))
    assert "Process 0 of 1 (fsdp2" in logged  # it did join a group and shard
    for a, b in zip(plain, sharded):
        for key, value in a.items():
            if key in IGNORED or key.startswith("time/"):
                continue
            assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    w1, w2 = _weights(tmp_path / "plain"), _weights(tmp_path / "sharded")
    for key in w1:
        torch.testing.assert_close(w2[key], w1[key], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_sharded_checkpoint_resumes_exactly(tmp_path, tiny_llama_dir, strategy):
    """2 processes write one checkpoint with torch.distributed.checkpoint (FSDP2: each its shards);
    a run resumed from the first continues as the uninterrupted run (same world size), and the
    newest exports, in one process, as the run's final policy."""
    overrides = [f"distributed.strategy={strategy}", "value_model.init=policy", "ppo.num_iterations=3",
                 "checkpoint.every=1", "checkpoint.keep=null"]
    whole = _run(tmp_path / "whole", tiny_llama_dir, 2, *overrides)
    cut = tmp_path / "cut"  # the same run, copied rather than run again: cut after checkpoint 1
    shutil.copytree(tmp_path / "whole", cut)
    for later in ("iter_00000002", "iter_00000003"):
        shutil.rmtree(cut / "checkpoints" / later)
    resumed = _run(cut, tiny_llama_dir, 2, *overrides)
    strip = lambda rows: [{k: v for k, v in r.items() if k not in IGNORED and not k.startswith("time/")}  # noqa: E731
                          for r in rows]
    assert [r["iteration"] for r in resumed] == [0, 1, 2]
    assert strip(resumed) == strip(whole)
    # rlhf-torchrl export of the run's newest checkpoint, in this one process without torchrun
    # (FSDP2: the shards of 2 processes consolidated): the weights the run gathered into policy/
    # at its end, to the bit, and so their logits
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_torchrl.trainers.export import export_checkpoint

    exported = export_checkpoint(str(tmp_path / "whole"), str(tmp_path / "exported"))
    assert exported.iteration == 3 and exported.source == {
        "fsdp2": "FSDP2, the shards of 2 processes", "ddp": "DDP, 2 processes"}[strategy]
    final, got = _weights(tmp_path / "whole"), load_file(tmp_path / "exported" / "model.safetensors")
    assert got.keys() == final.keys() and all(torch.equal(got[k], final[k]) for k in final)
    batch = AutoTokenizer.from_pretrained(tmp_path / "exported")(["The film was", "Its story"],
                                                                  padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = [AutoModelForCausalLM.from_pretrained(path)(**batch).logits
                  for path in (tmp_path / "whole" / "policy", tmp_path / "exported")]
    assert torch.equal(*logits)


def test_ddp_overlap_resume_after_the_whole_job_is_killed(tmp_path, tiny_llama_dir):
    """2 processes sampling one update ahead: every process of the job is SIGKILLed once
    checkpoint 1 of 3 exists (a lost node), then the same command resumes. Each process's rows
    sampled ahead are its own in the checkpoint, so every iteration equals the uninterrupted
    run's (they were all rank 0's rows before)."""
    import time

    overrides = ["distributed.strategy=ddp", "collection.overlap=1",
                 "generation.log_probs_from_sampling=false", "ppo.num_iterations=3",
                 "checkpoint.every=1", "checkpoint.keep=null"]
    whole = _run(tmp_path / "whole", tiny_llama_dir, 2, *overrides)
    cut = tmp_path / "cut"
    command = ["torchrun", "--standalone", "--nproc_per_node=2", str(ROOT / "recipes" / "ppo.py"),
               f"model.policy={tiny_llama_dir}", f"output_dir={cut}", f"hydra.run.dir={cut}",
               *TINY, *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not (cut / "checkpoints" / "iter_00000001").is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended first"
        time.sleep(0.005)
    kill_tree(proc.pid)  # torchrun and its workers (sessions of their own)
    proc.wait()
    assert not (cut / "checkpoints" / "iter_00000003").exists()
    resumed = _run(cut, tiny_llama_dir, 2, *overrides)
    strip = lambda rows: [{k: v for k, v in r.items() if k not in IGNORED and not k.startswith("time/")}  # noqa: E731
                          for r in rows]
    assert [r["iteration"] for r in resumed] == [0, 1, 2]
    assert strip(resumed) == strip(whole)


def _rank_pid(torchrun_pid: int, rank: int) -> int | None:
    """The pid of torchrun's worker of ``rank`` (read from its environment), or None yet."""
    for pid in process_tree(torchrun_pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if env.get(b"RANK") == str(rank).encode() and env.get(b"TORCHELASTIC_RUN_ID"):
            return pid
    return None


def test_one_rank_sigkilled_stops_the_job_in_bounded_time_then_resumes_exactly(tmp_path,
                                                                               tiny_llama_dir):
    """Rank 1 alone SIGKILLed once checkpoint 1 of 3 exists (a lost GPU): torchrun stops rank 0
    and exits non-zero within a bound, no checkpoint left torn, and the same command resumes to
    the uninterrupted run's metrics."""
    import signal
    import time

    from rlhf_torchrl.trainers.checkpoint import list_checkpoints, verify_checkpoint

    overrides = ["distributed.strategy=ddp", "ppo.num_iterations=3", "checkpoint.every=1",
                 "checkpoint.keep=null"]
    whole = _run(tmp_path / "whole", tiny_llama_dir, 2, *overrides)
    cut = tmp_path / "cut"
    command = ["torchrun", "--standalone", "--nproc_per_node=2", str(ROOT / "recipes" / "ppo.py"),
               f"model.policy={tiny_llama_dir}", f"output_dir={cut}", f"hydra.run.dir={cut}",
               *TINY, *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    log = tmp_path / "cut.log"  # a file, not a pipe: nothing reads while the test polls
    with open(log, "w") as sink:
        proc = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not (cut / "checkpoints" / "iter_00000001").is_dir():
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended first"
            time.sleep(0.005)
        os.kill(_rank_pid(proc.pid, 1), signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(timeout=120)  # torchrun's own bound: SIGTERM, 30 s, SIGKILL
    finally:
        if proc.poll() is None:  # the test failed: nothing of the job outlives it
            kill_tree(proc.pid)
            proc.wait()
    output = log.read_text()
    assert proc.returncode != 0 and time.monotonic() - killed < 90, output[-3000:]
    # rank 0 says what happened in one line; no traceback from inside the collective it was in
    assert re.search(r"\nError: process 0 of 2 lost another process of the job \([^)]*Connection "
                     r"(reset|closed) by peer[^)]*\): the job stops here\.", output), output[-3000:]
    assert "gloo/transport" not in output.split("Error: process 0")[0], output[-3000:]
    for _, path in list_checkpoints(cut):
        verify_checkpoint(path)
    resumed = _run(cut, tiny_llama_dir, 2, *overrides)
    strip = lambda rows: [{k: v for k, v in r.items() if k not in IGNORED and not k.startswith("time/")}  # noqa: E731
                          for r in rows]
    assert [r["iteration"] for r in resumed] == [0, 1, 2]
    assert strip(resumed) == strip(whole)


#: 2 spawned processes: a gloo group, the loss wrapped in DDP, one backward, an all-gather of
#: tensors Python holds (as the recipe's metrics and rollout are gathered), then the group ended and
#: the wrapper dropped, by ``DataParallel.shutdown`` (``ours``) or by ``destroy_process_group`` and
#: letting go of the wrapper, torch's own way (``torch``). ``cycles`` times over; or once with the
#: all-gather still pending in gloo's thread (``pending``: process 1 joins it 2 s late), which
#: then holds the tensors' last references. ``env``: ``shutdown`` with each cycle's group joined
#: through ``MASTER_ADDR``/``MASTER_PORT``, process 0 late (a new store on the same port)
_SHUTDOWN = '''
import os, sys, time, torch, torch.distributed as dist, torch.multiprocessing as mp
from rlhf_torchrl.distributed import DataParallel

def cycles(rank, folder, n, way, pending):
    torch.set_num_threads(1)
    for i in range(n):
        if way == "env":  # MASTER_ADDR and MASTER_PORT: the same port every cycle, process 0 late
            time.sleep(1.5 * (rank == 0))
            dist.init_process_group("gloo", rank=rank, world_size=2)
        else:
            dist.init_process_group("gloo", rank=rank, world_size=2,
                                    store=dist.FileStore(os.path.join(folder, f"store{i}"), 2))
        parallel = DataParallel(rank=rank, world_size=2)
        loss = torch.nn.Linear(4, 1)
        parallel.wrap_loss(loss)
        parallel.loss(loss, torch.randn(2, 4)).sum().backward()
        times = torch.ones(3)
        parts = [torch.empty_like(times) for _ in range(2)]
        if pending and rank == 1:
            time.sleep(2)
        work = dist.all_gather(parts, times, async_op=True)
        if not pending or rank == 1:
            work.wait()
        del work, parts, times
        if way == "torch":
            dist.destroy_process_group()
            parallel._ddp = None
        else:
            parallel.shutdown()

if __name__ == "__main__":
    n, way, pending = int(sys.argv[2]), sys.argv[3], sys.argv[4] == "pending"
    mp.start_processes(cycles, args=(sys.argv[1], n, way, pending), nprocs=2, start_method="spawn")
    print("done")
'''


def _shutdown(folder: Path, way: str, cycles: int = 1, pending: bool = False,
              timeout: float = 60) -> None:
    import socket

    script = folder / "shutdown.py"
    script.write_text(_SHUTDOWN)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    proc = run_bounded([sys.executable, "-W", "ignore", str(script), str(folder), str(cycles), way,
                        "pending" if pending else "done"], timeout=timeout, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "done", proc.stdout + proc.stderr[-3000:]


def test_a_process_group_ends_without_hanging_its_process(tmp_path):
    """``DataParallel.shutdown`` 50 times in 2 processes, then once while gloo's thread still holds
    a pending all-gather's tensors: every process ends. Before the group was freed by its own
    handle rather than the DDP wrapper's reducer, the 50 hung within their first 10 in each of 4
    runs, the pending one every time, and ``bench balance``'s tiny job about once in ten (CI,
    stop 58): the next test. And 3 groups in a row on one ``MASTER_PORT``, process 0 arriving
    late: each group is gone when the next starts (a group kept past its end kept its store's
    port, and the next group read the old one's keys and hung)."""
    for name in ("cycles", "pending", "env"):
        (tmp_path / name).mkdir()
    _shutdown(tmp_path / "cycles", "ours", cycles=50, timeout=120)
    _shutdown(tmp_path / "pending", "ours", pending=True)
    _shutdown(tmp_path / "env", "env", cycles=3)


@pytest.mark.xfail(strict=True, raises=RuntimeError,  # run_bounded: past its deadline, killed
                   reason="torch 2.13: DDP's reducer, freed holding the GIL, is the last holder of "
                          "the gloo group; the group's destructor joins gloo's threads, one of "
                          "which needs the GIL to release the last collective's tensors")
def test_torch_own_way_of_ending_a_ddp_process_group_can_hang(tmp_path):
    """The upstream failure ``DataParallel.shutdown`` works around: ``destroy_process_group()``
    and the wrapper let go while gloo's thread holds a pending all-gather's tensors hangs, every
    time (a strict xfail: when torch frees the group without the GIL, this passes and the
    workaround can go)."""
    _shutdown(tmp_path, "torch", pending=True, timeout=30)
