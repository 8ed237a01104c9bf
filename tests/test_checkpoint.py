"""Checkpoint functions on a tiny model: a resumed run's lineage and its pruning, an iteration
written again, each process's random states; and the trainer setting them after the collector."""

import os
import random
from pathlib import Path

import pytest
import torch

from rlhf_torchrl.trainers import checkpoint
from rlhf_torchrl.trainers import disk as checkpoint_disk
from rlhf_torchrl.trainers.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_trainer_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _save(out, iteration, model, **kwargs) -> str:
    """Checkpoint ``iteration`` of ``model``; its trainer state names the writer (``tag``)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tag = kwargs.pop("tag", "first")
    return save_checkpoint(str(out), iteration, modules={"m": model}, optimizer=optimizer,
                           trainer_state={"iteration": iteration, "tag": tag}, config_yaml="a: 1\n",
                           **kwargs)


def _written(out) -> list[tuple[int, str]]:
    """(iteration, writer's tag) of the checkpoints under their final names."""
    return [(n, load_trainer_state(path)["tag"]) for n, path in list_checkpoints(str(out))]


def _abandoned(out) -> list[tuple[int, str]]:
    found = []
    for path in sorted((Path(out) / "checkpoints" / checkpoint.ABANDONED).glob("*/iter_*")):
        found.append((int(path.name[5:]), load_trainer_state(str(path))["tag"]))
    return sorted(found)


def test_lineage_membership_by_hand():
    in_lineage = checkpoint.in_lineage
    lineage = [["a", 0], ["b", 2], ["c", 2], ["d", 5]]  # b resumed at 2 and died before a write
    assert [in_lineage(lineage, n, "a") for n in (1, 2, 3)] == [True, True, False]
    assert [in_lineage(lineage, n, "c") for n in (2, 3, 5, 6)] == [False, True, True, False]
    assert not in_lineage(lineage, 3, "b") and in_lineage(lineage, 6, "d")
    assert in_lineage([["a", 4]], 3, None) and not in_lineage([["a", 4]], 5, None)  # older versions


def test_resumed_run_never_prunes_its_own_new_checkpoint(tmp_path, model):
    """Iterations 1-6 on disk, a run resumed from 2 writes 3 with keep=2: it keeps 2 and its own 3
    (pruning by number would keep the abandoned 5 and 6); the old 3-6 are moved aside, whole."""
    for n in range(1, 7):
        _save(tmp_path, n, model)
    _save(tmp_path, 3, model, keep=2, tag="resumed")
    assert _written(tmp_path) == [(2, "first"), (3, "resumed")]
    assert latest_checkpoint(str(tmp_path)).endswith("iter_00000003")  # resume=auto continues it
    assert _abandoned(tmp_path) == [(n, "first") for n in (3, 4, 5, 6)]
    for path in (tmp_path / "checkpoints" / checkpoint.ABANDONED).glob("*/iter_*"):
        checkpoint.verify_checkpoint(str(path))  # complete: resumable with resume=<path>
    _save(tmp_path, 4, model, keep=2, tag="resumed")
    assert _written(tmp_path) == [(3, "resumed"), (4, "resumed")]


def test_lineages_of_three_runs(tmp_path, model):
    """a writes 1-4; b resumes a's 2 and writes 3, 4; c resumes a's 4 (set aside by b) and writes
    5: b's checkpoints are not c's lineage, a's 2 is."""
    a, b, c = [["a", 0]], [["a", 0], ["b", 2]], [["a", 0], ["c", 4]]
    for n in range(1, 5):
        _save(tmp_path, n, model, lineage=a, tag="a")
    for n in (3, 4):
        _save(tmp_path, n, model, lineage=b, keep=3, tag="b")
    assert _written(tmp_path) == [(2, "a"), (3, "b"), (4, "b")]
    assert _abandoned(tmp_path) == [(3, "a"), (4, "a")]
    _save(tmp_path, 5, model, lineage=c, keep=3, tag="c")
    assert _written(tmp_path) == [(2, "a"), (5, "c")]
    assert _abandoned(tmp_path) == [(3, "a"), (3, "b"), (4, "a"), (4, "b")]


def test_replacing_an_iteration_never_loses_the_old_one(tmp_path, model, monkeypatch):
    """A crash between setting the old iter_2 aside and renaming the new one in: no half
    checkpoint under the name, the old one whole, resume=auto takes iteration 1."""
    _save(tmp_path, 1, model)
    _save(tmp_path, 2, model)
    replace = os.replace

    def crash_on_rename_in(src, dst):
        if os.path.basename(src).startswith(".tmp-"):
            raise KeyboardInterrupt("killed before the rename")
        replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", crash_on_rename_in)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 2, model, tag="again")
    monkeypatch.undo()
    survivors = [path for path in (tmp_path / "checkpoints").rglob("iter_00000002")
                 if checkpoint.is_checkpoint(str(path))]
    assert [load_trainer_state(str(path))["tag"] for path in survivors] == ["first"]  # whole
    assert _written(tmp_path) == [(1, "first")]  # nothing under the name
    assert _abandoned(tmp_path) == [(2, "first")]
    assert latest_checkpoint(str(tmp_path), verify=True).endswith("iter_00000001")
    _save(tmp_path, 2, model, tag="again")  # the next write completes
    assert _written(tmp_path) == [(1, "first"), (2, "again")]


def _rng_worker(rank: int, folder: str) -> None:
    import torch.distributed as dist

    from rlhf_torchrl.distributed import DataParallel

    dist.init_process_group("gloo", init_method=f"file://{folder}/group", rank=rank, world_size=2)
    try:
        model = torch.nn.Linear(3, 2)
        torch.manual_seed(100 + rank)
        random.seed(100 + rank)
        parallel = DataParallel(rank=rank, world_size=2)
        path = save_checkpoint(folder, 1, modules={"m": model},
                               optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                               trainer_state={"iteration": 1}, config_yaml="", parallel=parallel,
                               rng=rng_state())
        expected = (torch.rand(4).tolist(), random.random())  # what this process draws next
        torch.manual_seed(0)
        random.seed(0)
        set_rng_state(checkpoint.load_rng_state(path, rank))
        torch.save({"expected": expected, "restored": (torch.rand(4).tolist(), random.random())},
                   os.path.join(folder, f"draws_{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_each_process_saves_and_restores_its_own_rng(tmp_path):
    """2 processes (gloo) with their own random streams: each gets its own back."""
    torch.multiprocessing.spawn(_rng_worker, args=(str(tmp_path),), nprocs=2)
    draws = [torch.load(tmp_path / f"draws_{rank}.pt") for rank in (0, 1)]
    for d in draws:
        assert d["restored"] == d["expected"]
    assert draws[0]["expected"] != draws[1]["expected"]


def test_rng_states_are_set_after_the_collector_is_built(tmp_path, tiny_llama_dir):
    """A collector whose construction draws random numbers: iteration 2 of a run resumed from
    checkpoint 2 draws what the uninterrupted run drew there."""
    from test_trainer import build

    from rlhf_torchrl.trainers.hooks import Checkpointer

    def run(trainer, resume=None) -> list:
        factory = trainer.collector

        def collector(start_batch, pending):  # e.g. a DataLoader's base seed, a warm-up
            torch.rand(8)
            random.random()
            return factory(start_batch, pending)

        trainer.collector = collector
        draws = []
        trainer.register_op("pre_collect", lambda: draws.append((torch.rand(2).tolist(), random.random())))
        trainer.register_hook("checkpoint", Checkpointer(str(tmp_path), every=1))
        if resume:
            trainer.load_checkpoint(resume)
        trainer.fit()
        return draws

    whole = run(build(tiny_llama_dir))
    resumed = run(build(tiny_llama_dir), resume=str(tmp_path / "checkpoints" / "iter_00000002"))
    assert len(whole) == 3 and resumed == whole[2:]


# ---- the disk a run fills, and weights-only checkpoints -------------------------------------


def _du(path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _trained(tiny_llama_dir):
    """The tiny Llama after one AdamW step (its moments exist), its value head beside it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    head = torch.nn.Linear(policy.config.hidden_size, 1)
    modules = {"policy": policy, "value_head": head}
    optimizer = torch.optim.AdamW([p for m in modules.values() for p in m.parameters()], lr=1e-3)
    policy(torch.tensor([[5, 6, 7]])).logits.sum().backward()
    head.weight.grad, head.bias.grad = torch.ones_like(head.weight), torch.ones_like(head.bias)
    optimizer.step()
    return modules, optimizer


def test_checkpoints_held_at_once_by_hand():
    held = checkpoint_disk.checkpoints_held
    assert held(20, 0, 10, 2) == 2  # iterations 10 and 20
    assert held(25, 0, 10, 2) == 3  # 10, 20, 25: two kept, a third while it is written
    assert held(25, 0, 10, None) == 3 and held(100, 0, 10, None) == 10
    assert held(100, 0, 10, 1) == 2 and held(40, 35, 10, 2) == 1  # (resumed at 35: 40 alone)
    assert held(40, 0, 0, 2) == 0


@pytest.mark.parametrize("weights_only", [False, True], ids=["with-adamw", "weights-only"])
def test_the_disk_plan_is_the_checkpoint_written(tmp_path, tiny_llama_dir, weights_only, caplog):
    """The planned size of a checkpoint is what save_checkpoint writes (to 2%: DCP's metadata,
    the trainer state); a weights-only one is a third of it and loads with AdamW afresh."""
    import logging

    modules, optimizer = _trained(tiny_llama_dir)
    plan = checkpoint_disk.plan_disk(modules, modules["policy"], num_iterations=4, every=2, keep=1,
                                     weights_only=weights_only)
    path = save_checkpoint(str(tmp_path), 2, modules=modules, optimizer=optimizer,
                           trainer_state={"iteration": 2}, config_yaml="a: 1\n",
                           weights_only=weights_only)
    assert _du(path) == pytest.approx(plan.checkpoint, rel=0.02)
    assert plan.checkpoints == 2 and plan.policy == _du_params(modules["policy"])
    tied = modules["policy"].get_input_embeddings().weight  # (written twice: two names)
    assert plan.weights == _du_params(modules["policy"]) + tied.numel() * 4 + 4 * 33
    assert plan.moments == (0 if weights_only else 2 * (plan.weights - tied.numel() * 4))

    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)  # untrained, no moments yet
    fresh = {"policy": policy, "value_head": torch.nn.Linear(policy.config.hidden_size, 1)}
    fresh_optimizer = torch.optim.AdamW([p for m in fresh.values() for p in m.parameters()], lr=1e-3)
    with caplog.at_level(logging.WARNING, logger="rlhf_torchrl.trainers.checkpoint"):
        checkpoint.load_checkpoint(path, modules=fresh, optimizer=fresh_optimizer)
    for name in modules:
        for a, b in zip(fresh[name].parameters(), modules[name].parameters()):
            assert torch.equal(a, b)
    if weights_only:  # AdamW's moments start at zero, and the log says so
        assert "AdamW's moments start afresh" in caplog.text
        for state in fresh_optimizer.state.values():  # (DCP's state dict makes them, as zeros)
            assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    else:
        assert "afresh" not in caplog.text and len(fresh_optimizer.state) == len(optimizer.state)
        for a, b in zip(fresh_optimizer.state.values(), optimizer.state.values()):
            assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


def _du_params(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_a_run_that_would_fill_its_disk_stops_before_training(tmp_path, tiny_llama_dir):
    """The real command on a real 12 MiB filesystem (tmpfs, in a user namespace): one line with
    the estimate and the settings that write less, before any iteration; the same command with
    checkpoint.every=0 and no saved policy fits and trains."""
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-rm", "true"], capture_output=True).returncode:
        pytest.skip("needs unshare -rm (user namespaces) to mount a small tmpfs")
    from test_recipe import TINY

    disk = tmp_path / "disk"
    disk.mkdir()
    overrides = [f"model.policy={tiny_llama_dir}", *TINY, "ppo.num_iterations=1", "eval.every=0",
                 "checkpoint.every=1", "threads=1"]
    command = " ".join([sys.executable, "-m", "rlhf_torchrl.cli", "ppo",
                        f"output_dir={disk}/run", f"hydra.run.dir={disk}/run", *overrides])
    script = f"mount -t tmpfs -o size=12m tmpfs {disk} && {command}"
    refused = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode == 1, refused.stderr[-2000:]
    (line,) = [x for x in refused.stderr.splitlines() if x.startswith("Error:")]
    assert "This run would write about" in line and "GiB free" in line
    assert "checkpoint.weights_only=true" in line and "Traceback" not in refused.stderr
    fits = subprocess.run(["unshare", "-rm", "sh", "-c",
                           script + " checkpoint.every=0 logging.save_model=false && ls " +
                           f"{disk}/run"], capture_output=True, text=True, timeout=300)
    assert fits.returncode == 0, fits.stderr[-2000:]
    assert "metrics.jsonl" in fits.stdout


def test_the_start_up_line_reads_as_written():
    plan = checkpoint_disk.DiskPlan
    GiB = checkpoint_disk.GiB
    assert plan(GiB, 2 * GiB, 1, GiB // 2).line() == (
        "about 3.5 GiB: 1 checkpoint of 3.0 GiB (2.0 GiB of it AdamW's moments), the policy 0.5 GiB")
    assert plan(GiB, 0, 3, 0).line() == "about 3.0 GiB: 3 checkpoints at once, 1.0 GiB each (weights only)"
    assert plan(0, 0, 0, 0).line() == "about 0.0 GiB: no checkpoint, no policy"


def test_a_resumed_runs_own_checkpoints_count_as_room(tmp_path, model):
    """The checkpoints already there are pruned as the run writes (keep): their bytes are room
    the plan's count of checkpoints at once already includes; with keep=None none is freed."""
    path = _save(tmp_path, 1, model)
    written = _du(path)
    assert checkpoint_disk.reclaimable_bytes(str(tmp_path), keep=2) == written > 0
    assert checkpoint_disk.reclaimable_bytes(str(tmp_path), keep=None) == 0
    assert checkpoint_disk.reclaimable_bytes(str(tmp_path / "none"), keep=2) == 0
