"""Checkpoints and exact resume: a resumed run continues as the uninterrupted run would have.

In-process runs resume from an intermediate checkpoint of a finished run (its later checkpoints
deleted, as if it had stopped there); subprocess runs are killed with SIGKILL, at a fixed point
mid-run and in the middle of a checkpoint write, then started again with the same command.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from test_recipe import RECIPES, _cfg, ppo

from rlhf_torchrl.config import builders, resume  # noqa: E402
from rlhf_torchrl.trainers import checkpoint
from rlhf_torchrl.trainers.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)

# one thread: the same summation order run to run (an adapting thread count changes it)
EXACT = ["threads=1", "checkpoint.every=1", "checkpoint.keep=null", "ppo.num_iterations=4"]
NOT_COMPARED = ("time/", "threads")


def _rows(run_dir) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(NOT_COMPARED)}
            for line in lines]


def _stop_at(run_dir, iteration: int) -> None:
    """Leave ``run_dir`` as a run interrupted after checkpoint ``iteration`` would (its later
    checkpoints gone; metrics of later iterations left for the resumed run to drop)."""
    for done, path in list_checkpoints(run_dir):
        if done > iteration:
            shutil.rmtree(path)


@pytest.mark.parametrize("overrides", [
    ["value_model.init=shared"],
    ["value_model.init=policy", "ppo.kl_target=1.0"],
    ["collection.overlap=1", "generation.log_probs_from_sampling=false", "ppo.tis_cap=2.0"],
    ["lora.r=4", "value_model.init=policy", "lora.critic=true"],
], ids=["shared-critic", "separate-critic-adaptive-kl", "async-overlap-1", "lora"])
def test_resumed_run_matches_the_uninterrupted_run(tmp_path, tiny_llama_dir, overrides):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    ppo.train(_cfg(whole, tiny_llama_dir, *EXACT, *overrides))
    ppo.train(_cfg(cut, tiny_llama_dir, *EXACT, *overrides))
    expected = _rows(whole)
    assert len(expected) == 4 and _rows(cut) == expected  # deterministic run to run (same process)
    _stop_at(cut, 2)
    report = ppo.train(_cfg(cut, tiny_llama_dir, *EXACT, *overrides))  # resume=auto
    assert _rows(cut) == expected  # iterations 0-1 kept, 2-3 redone identically, none twice
    assert report["iterations"] == 4
    assert [done for done, _ in list_checkpoints(cut)] == [1, 2, 3, 4]
    scalars = cut / "ppo" / "scalars" / "objective" / "scores.csv"
    if scalars.exists():  # the CSV logger's copy holds each iteration once as well
        assert [line.split(",")[0] for line in scalars.read_text().splitlines()] == ["0", "1", "2", "3"]


def test_resume_from_a_path_and_never(tmp_path, tiny_llama_dir):
    first = tmp_path / "first"
    ppo.train(_cfg(first, tiny_llama_dir, *EXACT))
    # a path: continue another run's checkpoint 3 in a new directory
    other = tmp_path / "other"
    checkpoint = first / "checkpoints" / "iter_00000003"
    ppo.train(_cfg(other, tiny_llama_dir, *EXACT, f"resume={checkpoint}"))
    assert [r["iteration"] for r in _rows(other)] == [3]
    assert _rows(other) == _rows(first)[3:]
    # never: start over, the earlier checkpoints and metrics gone
    ppo.train(_cfg(first, tiny_llama_dir, *EXACT, "resume=never", "ppo.num_iterations=1"))
    assert [done for done, _ in list_checkpoints(first)] == [1]
    assert [r["iteration"] for r in _rows(first)] == [0]


def test_resume_with_other_models_data_or_rewards_is_refused(tmp_path, tiny_llama_dir):
    ppo.train(_cfg(tmp_path, tiny_llama_dir, *EXACT, "ppo.num_iterations=1"))
    # the same run may go on longer, with another schedule
    resume.resume_path(_cfg(tmp_path, tiny_llama_dir, *EXACT, "ppo.num_iterations=3", "optim.lr=1e-6"))
    checkpoint = str(latest_checkpoint(tmp_path))
    other_task = ["task=arithmetic", "data.limit=8", "eval.every=0"]
    for setting, overrides in [("auto", other_task), (checkpoint, other_task),
                              ("auto", ["data.template='Review: {prompt}'"])]:
        cfg = _cfg(tmp_path, tiny_llama_dir, *EXACT, f"resume={setting}", *overrides)
        with pytest.raises(ValueError, match="Cannot resume from .*(data.source|data.template)") as info:
            ppo.train(cfg)
        assert "resume=never" in str(info.value)
    assert "data.source: 'polarity' in the checkpoint, 'reasoning_gym:basic_arithmetic' now" in str(
        pytest.raises(ValueError, resume.resume_path,
                      _cfg(tmp_path, tiny_llama_dir, *EXACT, *other_task)).value)
    assert [r["iteration"] for r in _rows(tmp_path)] == [0]  # nothing of the run was touched


def test_keep_prunes_old_checkpoints(tmp_path, tiny_llama_dir):
    ppo.train(_cfg(tmp_path, tiny_llama_dir, "checkpoint.every=1", "checkpoint.keep=2",
                   "ppo.num_iterations=3"))
    assert [done for done, _ in list_checkpoints(tmp_path)] == [2, 3]


def test_interrupted_checkpoint_write_leaves_the_previous_one(tmp_path, monkeypatch):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    save = dict(modules={"m": model}, optimizer=optimizer, config_yaml="a: 1\n")
    save_checkpoint(str(tmp_path), 1, trainer_state={"iteration": 1}, **save)
    weights = model.weight.detach().clone()

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed while writing")

    with torch.no_grad():
        model.weight.add_(1.0)
    with monkeypatch.context() as m:
        # every file is written, the rename has not happened
        m.setattr(checkpoint, "_fsync_tree", crash)
        with pytest.raises(KeyboardInterrupt):
            save_checkpoint(str(tmp_path), 2, trainer_state={"iteration": 2}, **save)
    assert (tmp_path / "checkpoints" / ".tmp-iter_00000002").exists()
    latest = latest_checkpoint(str(tmp_path))
    assert latest.endswith("iter_00000001")
    state = load_checkpoint(latest, modules={"m": model}, optimizer=optimizer)
    assert state == {"iteration": 1} and torch.equal(model.weight, weights)
    # the next write replaces the torn temporary directory
    save_checkpoint(str(tmp_path), 2, trainer_state={"iteration": 2}, **save)
    assert not (tmp_path / "checkpoints" / ".tmp-iter_00000002").exists()
    assert latest_checkpoint(str(tmp_path)).endswith("iter_00000002")


# ---- SIGKILL in a subprocess --------------------------------------------------------------------
def _command(tiny_llama_dir, out) -> list[str]:
    from test_recipe import IN_PROCESS, TINY

    return [sys.executable, str(RECIPES / "ppo.py"), f"output_dir={out}",
            f"model.policy={tiny_llama_dir}", *TINY, *IN_PROCESS, *EXACT, "ppo.num_iterations=5"]


def _env():
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE"}


def _run_until(command, out, condition, timeout=300) -> bool:
    """Start ``command``; SIGKILL it as soon as ``condition(out)`` holds. True if it was killed,
    False if it finished first."""
    with tempfile.TemporaryFile() as stderr:  # a file, not a pipe: nothing reads while it polls
        proc = subprocess.Popen(command, env=_env(), stdout=subprocess.DEVNULL, stderr=stderr,
                                start_new_session=True)
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            if condition(out):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return True
            time.sleep(0.001)
        if proc.poll() is None:  # past the deadline: nothing of the run outlives the test
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        stderr.seek(0)
        assert proc.returncode == 0, stderr.read().decode()[-3000:]
    return False


def _complete(command, out) -> None:
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


#: the tests of one uninterrupted run (a module fixture): one worker, one at a time, under pytest -n
#: (beside the torchrun and Ray tests' worker, not after them)
def SERIAL(test):
    """One worker, one at a time; in the suite of its own (pyproject.toml's markers)."""
    return pytest.mark.processes(pytest.mark.xdist_group("resume")(test))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_llama_dir):
    out = tmp_path_factory.mktemp("uninterrupted")
    _complete(_command(tiny_llama_dir, out), out)
    return _rows(out)


@SERIAL
def test_sigkill_mid_run_then_resume(tmp_path, tiny_llama_dir, uninterrupted):
    out = tmp_path / "run"
    command = _command(tiny_llama_dir, out)
    # killed while iteration `at` runs (or just after it logs): a fixed point, so that a failure
    # is the same on the next run (the write-time kill is the other test's)
    at = 3
    killed = _run_until(command, out, lambda o: len(_safe_rows(o)) >= at)
    assert killed
    _complete(command, out)
    assert _rows(out) == uninterrupted


@SERIAL
def test_sigkill_during_a_checkpoint_write_then_resume(tmp_path, tiny_llama_dir, uninterrupted):
    out = tmp_path / "run"
    command = _command(tiny_llama_dir, out)

    def writing(o):  # a checkpoint after the first is being written (a complete one exists)
        return sorted(p.name for p in (o / "checkpoints").glob(".tmp-iter_*")
                      if p.name != ".tmp-iter_00000001")

    assert _run_until(command, out, writing), "no checkpoint write was caught"
    (torn,) = writing(out)
    # the latest complete checkpoint is the one before the torn write
    assert int(Path(latest_checkpoint(str(out))).name[5:]) == int(torn[10:]) - 1
    _complete(command, out)
    assert _rows(out) == uninterrupted


@SERIAL
def test_sigkill_mid_mixture_run_then_resume(tmp_path, tiny_llama_dir):
    """A mixture of a folder of Parquet shards (weight 3) and a CSV file (weight 1), killed while
    an iteration runs and started again with the same command, logs what the uninterrupted run
    logs: each batch's sources and rows depend on the seed and the batch index alone, and the
    held-out prompts are carved out the same way each start."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "shards").mkdir()
    for k in range(2):
        pq.write_table(pa.table({"prompt": [f"The film number {8 * k + i} was" for i in range(8)]}),
                       tmp_path / "shards" / f"part-{k}.parquet")
    (tmp_path / "shows.csv").write_text("prompt\n" + "".join(f"I watched show {i} and\n" for i in range(16)))
    mixture = (f"data.sources=[{{source: {tmp_path / 'shards'}, weight: 3}}, "
               f"{{source: {tmp_path / 'shows.csv'}, weight: 1}}]")
    whole, out = tmp_path / "whole", tmp_path / "run"
    _complete([*_command(tiny_llama_dir, whole), mixture, "eval.every=2"], whole)
    command = [*_command(tiny_llama_dir, out), mixture, "eval.every=2"]
    assert _run_until(command, out, lambda o: len(_safe_rows(o)) >= 3)
    _complete(command, out)
    assert _rows(out) == _rows(whole) and len(_rows(whole)) == 5


@SERIAL
def test_the_disk_filling_mid_run_stops_it_in_one_line_then_it_resumes(tmp_path, tiny_llama_dir,
                                                                       uninterrupted):
    """A real filesystem filling up (a tmpfs in a user namespace, filled by another process once
    checkpoint 1 exists): the run stops with one line, leaves no partial checkpoint, the ones
    written verify, and once there is room the same command ends as the uninterrupted run."""
    import shlex

    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-rm", "true"], capture_output=True).returncode:
        pytest.skip("needs unshare -rm (user namespaces) to mount a small tmpfs")
    disk, kept = tmp_path / "disk", tmp_path / "kept"
    disk.mkdir()
    kept.mkdir()
    out = disk / "run"
    command = shlex.join(_command(tiny_llama_dir, out))
    # the tmpfs lives as long as the namespace: the whole story runs in one shell there
    script = f"""
        mount -t tmpfs -o size=256m tmpfs {disk}
        {command} 2> {kept}/first.err &
        run=$!
        while [ ! -d {out}/checkpoints/iter_00000001 ] && kill -0 $run 2>/dev/null; do sleep 0.01; done
        cat /dev/zero > {disk}/filler 2>/dev/null
        wait $run; echo $? > {kept}/first.status
        cp -r {out}/checkpoints {kept}/checkpoints
        rm {disk}/filler
        {command} 2> {kept}/second.err; echo $? > {kept}/second.status
        cp {out}/metrics.jsonl {kept}/metrics.jsonl
    """
    subprocess.run(["unshare", "-rm", "sh", "-c", script], env=_env(), timeout=600, check=True)
    first = (kept / "first.err").read_text()
    assert (kept / "first.status").read_text().strip() == "1", first[-3000:]
    assert "Traceback" not in first, first[-3000:]
    (line,) = [x for x in first.splitlines() if x.startswith("Error:")]
    assert "disk" in line and "resume=auto continues from the newest" in line
    assert not list((kept / "checkpoints").glob(".tmp-*"))  # no partial write left
    written = sorted((kept / "checkpoints").glob("iter_*"))
    assert written and written[0].name == "iter_00000001"
    for path in written:
        checkpoint.verify_checkpoint(str(path))
    second = (kept / "second.err").read_text()
    assert (kept / "second.status").read_text().strip() == "0", second[-3000:]
    assert _rows(kept) == uninterrupted


def _safe_rows(out) -> list:
    try:
        return (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []


@SERIAL
def test_same_seed_same_metrics_run_to_run(tmp_path, tiny_llama_dir, uninterrupted):
    """Determinism on CPU: a second process with the same seed and config logs the same metrics;
    another seed does not."""
    again = tmp_path / "again"
    _complete(_command(tiny_llama_dir, again), again)
    assert _rows(again) == uninterrupted
    other = tmp_path / "other"
    _complete([*_command(tiny_llama_dir, other), "seed=1", "ppo.num_iterations=1"], other)
    assert _rows(other)[0] != uninterrupted[0]


def test_lora_checkpoint_holds_the_adapters_and_value_head_only(tmp_path, tiny_llama_dir):
    from torch.distributed.checkpoint import FileSystemReader

    ppo.train(_cfg(tmp_path, tiny_llama_dir, "lora.r=4", "ppo.num_iterations=1"))
    ((_, path),) = list_checkpoints(tmp_path)
    keys = FileSystemReader(os.path.join(path, "weights")).read_metadata().state_dict_metadata
    weights = [k for k in keys if k.startswith("model.")]
    assert any("lora_A" in k for k in weights) and any(k.startswith("model.value_head") for k in weights)
    assert all("lora_" in k or k.startswith("model.value_head") for k in weights), weights


def test_finished_run_is_left_as_it_is(tmp_path, tiny_llama_dir, monkeypatch, capsys):
    """The same command again on a finished run: it says so, loads nothing, keeps the report
    (with its held-out before/after table)."""
    cfg = _cfg(tmp_path, tiny_llama_dir, "ppo.num_iterations=2", "eval.every=1")
    first = ppo.train(cfg)
    saved = {name: (tmp_path / name).read_bytes() for name in ("report.json", "report.html")}
    assert "held_out_samples" in json.loads(saved["report.json"])

    def no_loading(*args, **kwargs):
        raise AssertionError("a finished run must not load its models again")

    monkeypatch.setattr(builders, "make_models", no_loading)
    again = ppo.train(_cfg(tmp_path, tiny_llama_dir, "ppo.num_iterations=2", "eval.every=1"))
    assert "holds this run, finished (2 iterations)" in capsys.readouterr().out
    assert again["final_score"] == first["final_score"] and "held_out_samples" in again
    assert {name: (tmp_path / name).read_bytes() for name in saved} == saved
    # asked for more iterations, the run goes on from its last checkpoint
    with pytest.raises(AssertionError, match="must not load"):
        ppo.train(_cfg(tmp_path, tiny_llama_dir, "ppo.num_iterations=3", "eval.every=1"))


def test_resume_with_another_seed_or_batch_size_is_refused(tmp_path, tiny_llama_dir):
    """The seed and the batch size decide the prompt order and each row's random stream: a
    resume that changes them would not continue the run, so it is refused, naming them."""
    ppo.train(_cfg(tmp_path, tiny_llama_dir, *EXACT, "ppo.num_iterations=1"))
    for override, named in [("seed=1", "seed: 0 in the checkpoint, 1 now"),
                            ("ppo.batch_size=8", "ppo.batch_size: 4 in the checkpoint, 8 now"),
                            ("eval.every=0", "held-out prompts")]:
        with pytest.raises(ValueError, match="Cannot resume") as info:
            resume.resume_path(_cfg(tmp_path, tiny_llama_dir, *EXACT, override))
        assert named in str(info.value)


def test_torn_checkpoint_is_named_and_the_one_before_used(tmp_path, tiny_llama_dir, caplog):
    """A bad disk tore the newest checkpoint's files: resume=auto names it and continues from
    the one before (the run still equals the uninterrupted one); resume=<that path> stops with
    one line."""
    from rlhf_torchrl.trainers.checkpoint import CheckpointError

    cut = tmp_path / "cut"
    ppo.train(_cfg(cut, tiny_llama_dir, *EXACT, "ppo.num_iterations=3"))
    whole = _rows(cut)  # (a run is deterministic: the uninterrupted one)
    _stop_at(cut, 2)
    (cut / "report.json").unlink()
    newest = cut / "checkpoints" / "iter_00000002"
    (newest / "config.yaml").write_bytes(b"seed: \x00\x9f\xff torn\n")  # yaml: a ReaderError
    with pytest.raises(CheckpointError, match="iter_00000002 is (torn|unreadable)"):
        resume.resume_path(_cfg(cut, tiny_llama_dir, *EXACT, f"resume={newest}"))
    trainer_pt = cut / "checkpoints" / "iter_00000001" / "trainer.pt"
    with caplog.at_level("WARNING"):
        ppo.train(_cfg(cut, tiny_llama_dir, *EXACT, "ppo.num_iterations=3"))
    assert "iter_00000002" in caplog.text and "resuming from the checkpoint before it" in caplog.text
    assert _rows(cut) == whole
    # a file cut short: found by its size before it is read
    with open(trainer_pt, "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointError, match="trainer.pt has 10 bytes"):
        resume.resume_path(_cfg(cut, tiny_llama_dir, *EXACT, f"resume={trainer_pt.parent}"))


class _Payload:
    """Unpickling it would run code: what a crafted trainer.pt could do."""

    def __reduce__(self):
        return (os.system, ("touch /tmp/rlhf_torchrl_pwned",))


def test_a_checkpoint_cannot_run_code_when_resumed(tmp_path, tiny_llama_dir):
    ppo.train(_cfg(tmp_path, tiny_llama_dir, *EXACT, "ppo.num_iterations=1"))
    (_, path), = list_checkpoints(tmp_path)
    trainer_pt = Path(path) / "trainer.pt"
    state = torch.load(trainer_pt, weights_only=True)  # what it holds loads safely
    torch.save({**state, "rng": _Payload()}, trainer_pt)
    (Path(path) / "manifest.json").unlink()  # (the size check would catch it first)
    if os.path.exists("/tmp/rlhf_torchrl_pwned"):
        os.remove("/tmp/rlhf_torchrl_pwned")
    from rlhf_torchrl.safe_loading import UnsafeFileError

    with pytest.raises(UnsafeFileError, match="trainer.pt is not plain data.*posix.system"):
        resume.resume_path(_cfg(tmp_path, tiny_llama_dir, *EXACT, f"resume={path}"))
    assert not os.path.exists("/tmp/rlhf_torchrl_pwned")


def test_checkpoint_time_is_logged_and_counted(tmp_path, tiny_llama_dir):
    ppo.train(_cfg(tmp_path, tiny_llama_dir, *EXACT, "ppo.num_iterations=2"))
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        phases = sum(v for k, v in row.items() if k.startswith("time/") and k not in (
            "time/total", "time/tokens_per_second"))
        assert row["time/checkpoint"] > 0 and row["time/total"] >= phases


def test_a_row_lost_after_its_checkpoint_comes_back(tmp_path, tiny_llama_dir):
    """Killed after checkpoint 2 was written but before iteration 1's row was: the resumed run
    writes that row from the checkpoint, so every iteration appears once, and the report's
    samples are those of the uninterrupted run."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    expected = ppo.train(_cfg(whole, tiny_llama_dir, *EXACT, "ppo.num_iterations=3"))
    ppo.train(_cfg(cut, tiny_llama_dir, *EXACT, "ppo.num_iterations=3"))
    _stop_at(cut, 2)
    lines = (cut / "metrics.jsonl").read_text().splitlines()
    (cut / "metrics.jsonl").write_text(lines[0] + "\n")  # rows 1 and 2 never written
    (cut / "report.json").unlink()
    report = ppo.train(_cfg(cut, tiny_llama_dir, *EXACT, "ppo.num_iterations=3"))
    rows = _rows(cut)
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert rows == _rows(whole)
    assert report["samples_before"] == expected["samples_before"]
    assert report["samples_after"] == expected["samples_after"]
