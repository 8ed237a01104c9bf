"""Divergence guards: a NaN/inf is named where it appears; the run stops or skips the iteration."""

import math
import subprocess
import sys

import pytest
import torch
from tensordict import TensorDict
from test_recipe import RECIPES, _cfg, ppo
from test_resume import _rows

from rlhf_torchrl import keys as K
from rlhf_torchrl.trainers.guards import DivergenceError, NonFiniteError, check_finite
from rlhf_torchrl.trainers.update import ppo_update

CALLS = {"n": 0}


def nan_from_iteration_1(prompts, responses):
    """1.0 per response, NaN for the second row of the third call (the start-up probe is call 1,
    iteration 0 call 2: iteration 1)."""
    CALLS["n"] += 1
    scores = [1.0] * len(responses)
    if CALLS["n"] == 3:
        scores[1] = math.nan
    return scores


def test_nan_reward_stops_the_run_naming_it(tmp_path, tiny_llama_dir):
    CALLS["n"] = 0
    cfg = _cfg(tmp_path, tiny_llama_dir, "reward.functions=[test_guards.nan_from_iteration_1]",
               "ppo.num_iterations=3", "eval.every=0")  # (evaluation calls the reward too)
    with pytest.raises(DivergenceError) as info:
        ppo.train(cfg)
    message = str(info.value)
    assert message.startswith("Iteration 1: non-finite scores: 1 of 4 rows, in rows 1 "
                              "(from 'nan_from_iteration_1')")
    saved = tmp_path / "diverged" / "iter_00000001"
    assert f"{saved} (tensordict.TensorDict.load(path, allow_pickle=False) reads it)" in message
    assert "weights_only=False" not in message and "\n" not in message
    rollout = TensorDict.load(saved, allow_pickle=False)  # no code runs to read it
    assert math.isnan(float(rollout.get(K.SCORE)[1])) and rollout.shape == (4,)
    assert [r["iteration"] for r in _rows(tmp_path)] == [0]  # nothing logged for iteration 1


def test_nan_reward_skipped_iteration(tmp_path, tiny_llama_dir, caplog):
    CALLS["n"] = 0
    cfg = _cfg(tmp_path, tiny_llama_dir, "reward.functions=[test_guards.nan_from_iteration_1]",
               "ppo.num_iterations=3", "guards.non_finite=skip", "eval.every=0")
    with caplog.at_level("WARNING"):
        report = ppo.train(cfg)
    assert "Iteration 1: non-finite scores" in caplog.text and "skipped" in caplog.text
    rows = _rows(tmp_path)
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert rows[1]["guard/skipped"] == 1.0 and "objective/scores" not in rows[1]
    assert all(math.isfinite(r["objective/scores"]) for r in (rows[0], rows[2]))
    assert report["iterations"] == 2  # the statistics of the two good iterations


def test_kl_ceiling_warns_or_stops(tmp_path, tiny_llama_dir, stopping_llama_dir, caplog):
    """Another model as the reference: the KL is far above the ceiling from iteration 0."""
    far = [f"model.reference={stopping_llama_dir}", "guards.kl_ceiling=0.5", "ppo.num_iterations=1"]
    with caplog.at_level("WARNING"):
        ppo.train(_cfg(tmp_path / "a", tiny_llama_dir, *far))
    assert "is above guards.kl_ceiling=0.5" in caplog.text
    with pytest.raises(DivergenceError, match="Stopped \\(guards.kl_ceiling_stop=true\\)"):
        ppo.train(_cfg(tmp_path / "b", tiny_llama_dir, *far, "guards.kl_ceiling_stop=true"))


def _rollout(**values):
    mask = torch.tensor([[True, True, False], [True, False, False]])
    td = TensorDict({K.RESPONSE_MASK: mask, K.SCORE: torch.zeros(2)}, batch_size=[2])
    for key, value in values.items():
        td.set(key, value)
    return td


def test_check_finite_names_the_first_bad_quantity_and_ignores_padding():
    nan = math.nan
    # a NaN in padding is not an error
    check_finite(_rollout(**{"state_value": torch.tensor([[0.0, 1.0, nan], [1.0, nan, math.inf]])}))
    with pytest.raises(NonFiniteError, match="^non-finite values: 1 of 3 tokens, in rows 1$"):
        check_finite(_rollout(state_value=torch.tensor([[0.0, 1.0, 0.0], [math.inf, 0.0, 0.0]])))
    td = _rollout(advantage=torch.full((2, 3), nan))
    td.set(K.REF_LOG_PROB, torch.tensor([[nan, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    with pytest.raises(NonFiniteError, match="^non-finite reference log-probs"):
        check_finite(td)  # the reference comes before the advantages computed from it


def test_ppo_update_stops_before_a_non_finite_step(tiny_llama_dir, tokenizer):
    """A NaN in the advantages reaches the gradients: the step is not taken, the weights keep
    their values, and the error names the gradients and the losses."""
    from test_objectives import _prepared

    policy, loss, _, td = _prepared(tiny_llama_dir, tokenizer, critic_init="shared")
    td.get(K.ADVANTAGE)[:, 0] = math.nan  # every row: whichever minibatch comes first
    opt = torch.optim.AdamW([p for p in loss.parameters() if p.requires_grad], lr=1e-3)
    before = [p.detach().clone() for p in policy.parameters()]
    with pytest.raises(NonFiniteError, match="non-finite gradients: norm nan at optimiser step 1 "
                                             "of 2 .*loss/policy_avg nan"):
        ppo_update(td, loss, opt, num_ppo_epochs=1, num_mini_batches=2)
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters()))


def test_cli_prints_the_guard_message_without_traceback(tmp_path, tiny_llama_dir, stopping_llama_dir):
    from test_recipe import IN_PROCESS, TINY

    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(RECIPES / "ppo.py"), f"output_dir={out}", f"model.policy={tiny_llama_dir}",
         *TINY, *IN_PROCESS, f"model.reference={stopping_llama_dir}", "guards.kl_ceiling=0.5",
         "guards.kl_ceiling_stop=true"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "Error: Iteration 0: the KL to the reference" in proc.stderr
    assert "Traceback" not in proc.stderr
