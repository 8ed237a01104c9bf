"""Ctrl-C and SIGTERM on a real run: the iteration running finishes, a checkpoint of it is written,
one line gives the command that resumes, and that command continues the run exactly; a second
Ctrl-C stops at once, with one line. No traceback either way."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rlhf_torchrl.trainers.interrupt import InterruptHandler, RunInterrupted

TINY = ["ppo.batch_size=4", "ppo.num_mini_batches=2", "ppo.forward_batch_size=2",
        "generation.max_new_tokens=6", "logging.progress_bar=false", "data.limit=16",
        "optim.lr=1e-3", "eval.every=0", "optim.critic_warmup=0", "model.autocast=null",
        "threads=1", "checkpoint.every=100", "checkpoint.keep=null"]
def SERIAL(test):
    """One worker, one at a time; in the suite of its own (pyproject.toml's markers)."""
    return pytest.mark.processes(pytest.mark.xdist_group("interrupt")(test))


def _env():
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE",
            "RLHF_TORCHRL_TRACEBACK": ""}


def _rows(out) -> list[dict]:
    try:
        lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "threads"))}
            for line in lines if line.strip()]


def _command(model, out, iterations, *extra):
    return [sys.executable, "-m", "rlhf_torchrl.cli", "ppo", f"output_dir={out}",
            f"model.policy={model}", *TINY, f"ppo.num_iterations={iterations}", *extra]


def _signal_after(command, out, rows, signals, gap=0.0, timeout=300):
    """Start ``command``, send ``signals`` (``gap`` seconds apart) once ``rows`` metrics rows are
    written; returns (exit status, stderr)."""
    with tempfile.TemporaryFile("w+") as stderr:  # a file, not a pipe: nothing reads meanwhile
        proc = subprocess.Popen(command, env=_env(), stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            deadline = time.monotonic() + timeout
            while len(_rows(out)) < rows and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            if proc.poll() is not None:  # (the file is read once the run is gone: one offset)
                stderr.seek(0)
                raise AssertionError(f"finished before the signal:\n{stderr.read()[-3000:]}")
            for i, signum in enumerate(signals):
                if i:
                    time.sleep(gap)
                proc.send_signal(signum)
            proc.wait(timeout=max(1, deadline - time.monotonic()))
        finally:
            if proc.poll() is None:  # past the deadline: the run does not outlive the test
                proc.kill()
                proc.wait()
        stderr.seek(0)
        return proc.returncode, stderr.read()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_llama_dir):
    whole = tmp_path_factory.mktemp("whole")
    done = subprocess.run(_command(tiny_llama_dir, whole, 4), env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return _rows(whole)


@SERIAL
@pytest.mark.parametrize("signum,status,name", [(signal.SIGINT, 130, "Ctrl-C"),
                                                (signal.SIGTERM, 143, "SIGTERM")])
def test_a_stop_signal_checkpoints_the_iteration_and_the_printed_command_resumes_exactly(
        signum, status, name, tmp_path, tiny_llama_dir, uninterrupted):
    cut = tmp_path / "cut"
    code, err = _signal_after(_command(tiny_llama_dir, cut, 4), cut, rows=1, signals=[signum])
    assert code == status, err[-3000:]
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert any(line.startswith(f"{name}: the run stops after iteration ") for line in lines), err
    last = lines[-1]
    assert last.startswith(f"Stopped by {name} after "), last
    stopped_at = int(last.split(" after ")[1].split(" of ")[0])
    checkpoint = Path(re.search(r": checkpoint (\S+)\. Resume with", last)[1])
    assert 1 <= stopped_at < 4 and checkpoint.parent == cut / "checkpoints", last
    assert checkpoint.is_dir() and int(checkpoint.name.split("_")[1]) == stopped_at
    assert len(_rows(cut)) == stopped_at
    # the printed command, as a user pastes it, finishes the run as if it had not stopped
    command = shlex.split(last.split(" Resume with: ")[1])
    assert command[:2] == ["rlhf-torchrl", "ppo"] and f"output_dir={cut}" in command
    resumed = subprocess.run([sys.executable, "-m", "rlhf_torchrl.cli", *command[1:]], env=_env(),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _rows(cut) == uninterrupted


@SERIAL
def test_a_second_ctrl_c_stops_at_once_in_one_line(tmp_path, tiny_llama_dir):
    out = tmp_path / "run"
    slow = ["generation.max_new_tokens=48", "ppo.num_ppo_epochs=4"]  # an iteration of seconds
    code, err = _signal_after(_command(tiny_llama_dir, out, 50, *slow), out, rows=1,
                              signals=[signal.SIGINT, signal.SIGINT], gap=0.3)
    assert code == 130, err[-3000:]
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("Stopped at once by a second Ctrl-C during iteration "), last
    assert "checkpoint" not in last or "Resume with" in last


@SERIAL
def test_without_checkpoints_the_line_says_the_run_cannot_resume(tmp_path, tiny_llama_dir):
    out = tmp_path / "run"
    code, err = _signal_after(_command(tiny_llama_dir, out, 50, "checkpoint.every=0"), out, rows=1,
                              signals=[signal.SIGINT])
    assert code == 130 and "Traceback" not in err, err[-3000:]
    assert "no checkpoint (checkpoints are off: checkpoint.every=0), so it cannot resume" in err


def test_the_handler_restores_the_previous_handlers():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with InterruptHandler(lambda: "iteration 1 of 2") as handler:
        assert signal.getsignal(signal.SIGINT) == handler._handle
        handler._handle(signal.SIGTERM, None)
        assert handler.requested == signal.SIGTERM
        with pytest.raises(RunInterrupted, match="Stopped at once by a second Ctrl-C during "
                                                 "iteration 1 of 2") as stop:
            handler._handle(signal.SIGINT, None)
        assert stop.value.exit_status == 130 and isinstance(stop.value, KeyboardInterrupt)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_the_resume_line_names_the_install_that_ran(tmp_path, monkeypatch):
    """Started as a virtual environment's rlhf-torchrl that PATH does not find first, the resume
    line names that one; started as the one PATH finds (or as python -m), the plain name."""
    from rlhf_torchrl.config.builders import _this_command

    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    script = venv / "rlhf-torchrl"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.setattr(sys, "argv", [str(script), "ppo"])
    monkeypatch.setenv("PATH", str(tmp_path / "elsewhere"))
    assert _this_command() == str(script.resolve())
    monkeypatch.setenv("PATH", str(venv))
    assert _this_command() == "rlhf-torchrl"
    monkeypatch.setattr(sys, "argv", ["/x/rlhf_torchrl/cli.py", "ppo"])
    assert _this_command() == "rlhf-torchrl"
