"""On-policy distillation (issue 49, item 3): the teacher's log-probs and the per-token reward of
minus the reverse KL to it, against a plain per-row computation from the two models (fp32, the
sampling temperature, left-padded prompts); the refusal of a teacher of another vocabulary before
any weights load; the text mapping against the teacher run on each row's text; the recipe end to
end with a teacher that is a run's saved policy."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from rlhf_torchrl import functional as F
from rlhf_torchrl import keys as K
from rlhf_torchrl.data.rollout import probe_rollout
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.modules import TokenLevelActor, byte_tokenizer, compute_old_quantities
from rlhf_torchrl.objectives.kl_shaping import FixedKLController, KLRewardShaper
from rlhf_torchrl.rewards.distillation import (
    TeacherLogProbs,
    TextTeacherLogProbs,
    check_same_vocabulary,
    load_teacher,
    vocabulary_difference,
)

ROOT = Path(__file__).resolve().parents[1]
TEMPERATURE = 0.7
#: prompts of different lengths (left padding) and responses of different lengths, one that did
#: not stop, multi-byte text split over several tokens
PROMPTS = ["Say hi.", "Write one short sentence about a film you liked a lot.", "2 + 3?"]
RESPONSES = ["hi there", "It was great fun, 🙂 très bien", "5"]
STOPPED = [True, False, True]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, tokenizer) -> str:
    """A tiny Llama with the policy's tokenizer and other weights (another seed, wider): the
    teacher of the tiny student."""
    from conftest import _save_tiny, _tiny_llama

    torch.manual_seed(1)
    model = _tiny_llama(tokenizer, hidden_size=48, intermediate_size=96, num_attention_heads=4)
    with torch.no_grad():  # other weights than the student's seed-0 ones
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return _save_tiny(tmp_path_factory.mktemp("teacher_llama"), model, tokenizer)


@pytest.fixture(scope="module")
def byte_teacher_dir(tmp_path_factory) -> str:
    """A tiny Llama over the 260-token byte tokenizer: a teacher of another vocabulary."""
    from conftest import _save_tiny, _tiny_llama

    tok = byte_tokenizer()
    return _save_tiny(tmp_path_factory.mktemp("byte_teacher"), _tiny_llama(tok), tok)


def _rollout(tokenizer):
    return probe_rollout(PROMPTS, tokenizer, RESPONSES, stopped=STOPPED)


def _row_log_probs(model, prompt_ids, response_ids, temperature) -> torch.Tensor:
    """log p(response_t | prompt, response_<t) of one unpadded row, a plain forward."""
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0].double() / temperature
    n = len(prompt_ids)
    log_probs = logits.log_softmax(-1)[n - 1:-1]
    return log_probs.gather(-1, torch.tensor(response_ids).unsqueeze(-1)).squeeze(-1)


def _rows(rollout):
    """Each row's real prompt and response ids (no padding)."""
    prompt, pmask = rollout.get(K.PROMPT_TOKENS), rollout.get(K.PROMPT_MASK)
    response, rmask = rollout.get(K.RESPONSE_TOKENS), rollout.get(K.RESPONSE_MASK)
    return [(p[m].tolist(), r[n].tolist()) for p, m, r, n in zip(prompt, pmask, response, rmask)]


# ---- the pure functions --------------------------------------------------------------------------

def test_distillation_rewards_by_hand():
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.25, 0.0, 0.0]])
    teacher = torch.tensor([[-0.5, -3.0, -0.5], [-2.25, 4.0, 4.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    reward, kl = F.distillation_rewards(lp, teacher, mask, coef=2.0)
    assert torch.equal(kl, torch.tensor([[-0.5, 1.0, 0.0], [2.0, 0.0, 0.0]]))
    assert torch.equal(reward, -2.0 * kl)
    # k2 and k3 of log r = teacher - lp
    _, k2 = F.distillation_rewards(lp, teacher, mask, coef=1.0, estimator="k2")
    _, k3 = F.distillation_rewards(lp, teacher, mask, coef=1.0, estimator="k3")
    log_r = [[0.5, -1.0, 0.0], [-2.0, 0.0, 0.0]]
    for i in range(2):
        for t in range(3):
            m = float(mask[i, t])
            assert math.isclose(float(k2[i, t]), m * 0.5 * log_r[i][t] ** 2, abs_tol=1e-7)
            x = log_r[i][t]
            assert math.isclose(float(k3[i, t]), m * (math.exp(x) - 1 - x), abs_tol=1e-6)


def test_sequence_distillation_reward_lands_on_the_last_token():
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.25, -0.25, 0.0], [0.0, 0.0, 0.0]])
    teacher = torch.tensor([-4.0, -1.0, -7.0])
    mask = torch.tensor([[True, True, True], [True, True, False], [False, False, False]])
    reward, kl = F.sequence_distillation_rewards(lp, teacher, mask, coef=0.5)
    # log pi(y) - log pi_T(y): -3.5 + 4 = 0.5 and -0.5 + 1 = 0.5; a row without tokens: 0
    assert torch.equal(kl, torch.tensor([[0.0, 0.0, 0.5], [0.0, 0.5, 0.0], [0.0, 0.0, 0.0]]))
    assert torch.equal(reward, torch.tensor([[0.0, 0.0, -0.25], [0.0, -0.25, 0.0], [0.0, 0.0, 0.0]]))


# ---- the teacher's log-probs and the shaped reward ----------------------------------------------

def test_teacher_log_probs_and_reward_match_a_plain_computation(tokenizer, tiny_llama_dir, teacher_dir):
    """TeacherLogProbs (chunks of 2, the prompts left-padded) equals each row's plain forward at
    the sampling temperature; the shaped reward is -kl_coef (lp - ref) - teacher_coef (lp -
    teacher) per token plus the score at the last, hand-computed from three plain forwards."""
    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.mul_(0.9)  # a reference other than the policy
    teacher_model = load_teacher(teacher_dir, tokenizer)
    assert not any(p.requires_grad for p in teacher_model.parameters()) and not teacher_model.training

    rollout = _rollout(tokenizer)
    assert rollout.get(K.PROMPT_MASK)[:, 0].tolist() == [False, True, False]  # left-padded
    actor = TokenLevelActor(student, temperature=TEMPERATURE)
    ref_actor = TokenLevelActor(reference, temperature=TEMPERATURE, out_key=K.REF_LOG_PROB)
    compute_old_quantities(rollout, actor=actor, reference=ref_actor, chunk_size=2)
    teacher = TeacherLogProbs(teacher_model, temperature=TEMPERATURE, chunk_size=2)
    assert teacher.out_keys == [K.TEACHER_LOG_PROB]
    teacher(rollout)
    got = rollout.get(K.TEACHER_LOG_PROB)
    assert got.dtype == torch.float32 and got.shape == rollout.get(K.RESPONSE_MASK).shape
    mask = rollout.get(K.RESPONSE_MASK)
    assert torch.all(got[~mask] == 0)

    score = torch.tensor([0.3, -1.0, 2.0])
    rollout.set(K.SCORE, score)
    kl_coef, teacher_coef = 0.1, 0.5
    shaper = KLRewardShaper(FixedKLController(kl_coef), teacher_coef=teacher_coef)
    shaper(rollout)
    reward = rollout.get(K.REWARD).squeeze(-1)
    non_score = rollout.get(K.NON_SCORE_REWARD).squeeze(-1)
    for i, (prompt_ids, response_ids) in enumerate(_rows(rollout)):
        lp = _row_log_probs(student, prompt_ids, response_ids, TEMPERATURE)
        ref = _row_log_probs(reference, prompt_ids, response_ids, TEMPERATURE)
        tea = _row_log_probs(teacher_model, prompt_ids, response_ids, TEMPERATURE)
        n = len(response_ids)
        assert torch.allclose(got[i, :n].double(), tea, atol=1e-5), i
        assert torch.allclose(rollout.get(K.TEACHER_KL)[i, :n].double(), lp - tea, atol=1e-5)
        expected = -kl_coef * (lp - ref) - teacher_coef * (lp - tea)
        expected[-1] += float(score[i])
        assert torch.allclose(reward[i, :n].double(), expected, atol=1e-5), i
        assert torch.all(reward[i, n:] == 0)
        assert torch.allclose(non_score[i, :n].double(), expected - (torch.arange(n) == n - 1) * float(score[i]),
                              atol=1e-5)
    # the teacher's term is a KL term: not in the score the group baselines compare
    assert torch.equal(rollout.get(K.SHAPED_SCORE), score)
    # the adaptive controller sees the reference's KL alone
    from rlhf_torchrl.objectives.kl_shaping import make_kl_controller

    adaptive = KLRewardShaper(make_kl_controller(0.1, target=1.0, horizon=100), teacher_coef=teacher_coef)
    plain = KLRewardShaper(make_kl_controller(0.1, target=1.0, horizon=100))
    with_teacher, without = rollout.clone(), rollout.clone()
    without.exclude(K.TEACHER_LOG_PROB, K.TEACHER_KL, inplace=True)
    adaptive(with_teacher)
    plain(without)
    assert math.isclose(adaptive.update_kl_coef(with_teacher), plain.update_kl_coef(without), rel_tol=1e-6)
    # teacher_coef 0: the rollout's teacher log-probs change nothing
    off = rollout.clone()
    KLRewardShaper(FixedKLController(kl_coef), teacher_coef=0.0)(off)
    KLRewardShaper(FixedKLController(kl_coef))(without)
    assert torch.equal(off.get(K.REWARD), without.get(K.REWARD))


def test_group_baselines_credit_the_teacher_per_token_as_the_reference_kl():
    """GRPO and REINFORCE++ on a shaped rollout with a teacher: the teacher's term is part of the
    KL credit, A_t = group-relative score + sum_{t' >= t} (-kl_coef KL[t'] - teacher_coef KL_T[t']);
    REINFORCE++ whitens the returns of the whole reward."""
    from rlhf_torchrl.objectives.advantages import GRPOAdvantage, ReinforcePPAdvantage

    mask = torch.tensor([[True, True, True], [True, True, False]])
    lp = torch.tensor([[-1.0, -0.5, -2.0], [-0.25, -1.0, 0.0]])
    ref = torch.tensor([[-1.5, -0.5, -1.0], [-0.25, -2.0, 0.0]])
    teacher = torch.tensor([[-0.5, -1.5, -2.0], [-1.25, -1.0, 0.0]])
    td = TensorDict({K.LOG_PROB: lp, K.REF_LOG_PROB: ref, K.TEACHER_LOG_PROB: teacher,
                     K.RESPONSE_MASK: mask, K.SCORE: torch.tensor([1.0, 1.0]),
                     K.GROUP: torch.tensor([0, 0])}, batch_size=[2])
    KLRewardShaper(FixedKLController(0.1), teacher_coef=0.5)(td)
    GRPOAdvantage()(td)
    adv = td.get(K.ADVANTAGE).squeeze(-1)
    for i in range(2):
        n = int(mask[i].sum())
        per_token = [-0.1 * (lp[i, t] - ref[i, t]) - 0.5 * (lp[i, t] - teacher[i, t]) for t in range(n)]
        for t in range(n):  # equal scores: no score advantage, the KL terms' return-to-go alone
            assert math.isclose(float(adv[i, t]), float(sum(per_token[t:])), abs_tol=1e-6)
    ReinforcePPAdvantage()(td)
    returns = F.returns_to_go(td.get(K.REWARD).squeeze(-1), mask)
    assert torch.allclose(td.get(K.ADVANTAGE).squeeze(-1), F.masked_whiten(returns, mask) * mask)


def test_offloaded_teacher_runs_and_stays_on_the_cpu(tokenizer, teacher_dir):
    teacher = TeacherLogProbs(load_teacher(teacher_dir, tokenizer, offload=True), temperature=1.0,
                              offload=True)
    rollout = teacher(_rollout(tokenizer))
    assert torch.isfinite(rollout.get(K.TEACHER_LOG_PROB)).all()
    assert next(teacher.model.parameters()).device.type == "cpu"


# ---- another vocabulary --------------------------------------------------------------------------

def test_vocabulary_difference_names_what_differs(tokenizer, teacher_dir):
    from rlhf_torchrl.modules import load_tokenizer

    assert vocabulary_difference(tokenizer, load_tokenizer(teacher_dir)) is None
    assert vocabulary_difference(tokenizer, byte_tokenizer()) == \
        f"260 tokens against the policy's {len(tokenizer.get_vocab())}"

    class Swapped:  # the same tokens, two ids exchanged
        def get_vocab(self):
            vocab = dict(tokenizer.get_vocab())
            a, b = tokenizer.convert_ids_to_tokens([5, 9])
            vocab[a], vocab[b] = 9, 5
            return vocab

    token = tokenizer.convert_ids_to_tokens(5)
    assert vocabulary_difference(tokenizer, Swapped()) == \
        f"token {token!r} has id 9 there and id 5 in the policy's"
    with pytest.raises(ConfigError, match="another vocabulary") as e:
        check_same_vocabulary(tokenizer, Swapped(), teacher="reward.teacher=x")
    assert "\n" not in str(e.value) and "reward.teacher_mapping=text" in str(e.value)


def _cfg(tmp_path, *overrides):
    from rlhf_torchrl.config import compose

    return compose([f"output_dir={tmp_path}", *TINY, *overrides])


#: a tiny run: 2 iterations of 4 responses of at most 6 tokens, on the CPU, in fp32
TINY = ["ppo.num_iterations=2", "ppo.batch_size=4", "ppo.num_mini_batches=2",
        "ppo.forward_batch_size=2", "generation.max_new_tokens=6", "logging.progress_bar=false",
        "data.limit=16", "optim.lr=1e-3", "eval.num_prompts=4", "eval.every=0",
        "optim.critic_warmup=0", "model.autocast=null", "reuse_freed_memory=false", "device=cpu",
        "checkpoint.every=0"]


def test_teacher_of_another_vocabulary_is_refused_before_any_weights_load(tmp_path, monkeypatch,
                                                                          tiny_llama_dir, byte_teacher_dir):
    from transformers import AutoModelForCausalLM

    from rlhf_torchrl.config import builders

    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded before the teacher's tokenizer was checked")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    cfg = _cfg(tmp_path, f"model.policy={tiny_llama_dir}", f"reward.teacher={byte_teacher_dir}")
    with pytest.raises(ConfigError, match=rf"reward.teacher={byte_teacher_dir} has another vocabulary "
                                          r"than the policy \(260 tokens against") as e:
        builders.build_trainer(cfg)
    assert "\n" not in str(e.value)
    # a teacher that is no model at all: one line naming the setting
    cfg = _cfg(tmp_path, f"model.policy={tiny_llama_dir}", f"reward.teacher={tmp_path}/nothing")
    with pytest.raises(ConfigError, match=r"reward.teacher=.*nothing: no such directory"):
        builders.build_trainer(cfg)


def test_teacher_settings_refused_in_one_line(tmp_path, tiny_llama_dir):
    from rlhf_torchrl.config import checks

    def refused(*overrides, match):
        cfg = _cfg(tmp_path, f"model.policy={tiny_llama_dir}", *overrides)
        with pytest.raises(ConfigError, match=match) as e:
            checks.check_config(cfg)
        assert "\n" not in str(e.value)

    refused("reward.teacher=x", "reward.teacher_mapping=text", "reward.teacher_kl_estimator=k3",
            match="k3 = .* overflows")
    refused("reward.teacher=x", "reward.teacher_mapping=text", "env.tools=[calculator]",
            match="teacher_mapping=text reads single responses")
    refused("reward.teacher=x", "reward.functions=[]", "advantage.estimator=grpo",
            "advantage.filter_groups=true", "generation.samples_per_prompt=2", match="every group")
    refused("reward.functions=[]", match=r"No reward: .*reward.teacher")
    from rlhf_torchrl.config import validation

    for override, match in (("reward.teacher_mapping=bytes", r"reward.teacher_mapping='bytes'.*token.*text"),
                            ("reward.teacher_coef=-1", r"reward.teacher_coef=-1.0 is out of range"),
                            ("reward.teacher_kl_estimator=k4", r"reward.teacher_kl_estimator='k4'")):
        with pytest.raises(ConfigError, match=match):
            validation.validate(_cfg(tmp_path, "reward.teacher=x", override))
    # the teacher alone is a reward
    checks.check_config(_cfg(tmp_path, f"model.policy={tiny_llama_dir}", "reward.teacher=x",
                             "reward.functions=[]"))


def test_a_teacher_with_too_few_positions_is_refused(tmp_path, tokenizer, tiny_llama_dir):
    """A teacher reads the policy's prompt and response tokens: a learned position embedding too
    short for them is one line naming reward.teacher, before any weights load."""
    from conftest import _save_tiny
    from transformers import GPT2Config, GPT2LMHeadModel

    from rlhf_torchrl.config.model_checks import check_sequence_length

    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=4, n_positions=12)
    short = _save_tiny(tmp_path / "short", GPT2LMHeadModel(config), tokenizer)
    cfg = _cfg(tmp_path, f"model.policy={tiny_llama_dir}", f"reward.teacher={short}",
               "data.max_prompt_length=64")
    with pytest.raises(ConfigError, match=rf"more than the 12 positions of reward.teacher={short}"):
        check_sequence_length(cfg, ["Write one short sentence about a film you liked."], tokenizer)
    text = _cfg(tmp_path, f"model.policy={tiny_llama_dir}", f"reward.teacher={short}",
                "data.max_prompt_length=64", "reward.teacher_mapping=text")
    check_sequence_length(text, ["Write one short sentence about a film you liked."], tokenizer)


def test_cli_refuses_a_teacher_of_another_vocabulary_in_one_line(tmp_path, tiny_llama_dir,
                                                                 byte_teacher_dir):
    proc = subprocess.run(
        [sys.executable, "-c", "from rlhf_torchrl.cli import main; main()", "ppo",
         f"model.policy={tiny_llama_dir}", f"reward.teacher={byte_teacher_dir}",
         f"output_dir={tmp_path}/run", f"hydra.run.dir={tmp_path}/run", *TINY],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "has another vocabulary than the policy" in lines[0], proc.stderr


def test_plan_counts_the_teacher_like_the_reference(tmp_path, tiny_llama_dir, teacher_dir):
    """rlhf-torchrl plan holds the teacher's weights (reward.teacher_dtype) in every phase, or in
    the old quantities alone when it is offloaded."""
    from transformers import AutoConfig

    from rlhf_torchrl.modules.shapes import ModelShape
    from rlhf_torchrl.plan import GIB, PROFILES, make_plan

    weights = ModelShape.from_config(AutoConfig.from_pretrained(teacher_dir)).params * 2 / GIB
    cfg = _cfg(tmp_path, f"model.policy={tiny_llama_dir}", f"reward.teacher={teacher_dir}",
               "reward.teacher_dtype=bfloat16")
    plan = make_plan(cfg, profile=PROFILES["H100"], times=False)
    for phase in plan.phases.values():
        assert phase["held"]["teacher"] == pytest.approx(weights)
    offloaded = make_plan(_cfg(tmp_path, f"model.policy={tiny_llama_dir}", f"reward.teacher={teacher_dir}",
                               "reward.teacher_dtype=bfloat16", "reward.teacher_offload=true"),
                          profile=PROFILES["H100"], times=False)
    assert "teacher" not in offloaded.phases["update"]["held"]
    assert offloaded.phases["old_quantities"]["held"]["teacher (offloaded, visiting)"] == pytest.approx(weights)


# ---- the text mapping ----------------------------------------------------------------------------

def test_text_mapping_by_hand(tokenizer, byte_teacher_dir):
    """TextTeacherLogProbs re-tokenises each row for the teacher: the prompt's conversation through
    the teacher's chat template, the response's text, its EOS where the response stopped; the
    sequence log-prob equals the plain forward's sum, and the shaper puts -coef (log pi(y) -
    log pi_T(y)) at the last response token."""
    from transformers import AutoModelForCausalLM

    from rlhf_torchrl.modules import load_tokenizer

    teacher_tok = load_tokenizer(byte_teacher_dir)
    model = load_teacher(byte_teacher_dir, teacher_tok)
    teacher = TextTeacherLogProbs(model, teacher_tok, temperature=TEMPERATURE, chunk_size=2)
    rollout = _rollout(tokenizer)
    teacher(rollout)
    got = rollout.get(K.TEACHER_SEQUENCE_LOG_PROB)
    assert got.dtype == torch.float32 and got.shape == (3,)
    plain = AutoModelForCausalLM.from_pretrained(byte_teacher_dir).eval()
    expected = []
    for prompt, response, stopped in zip(PROMPTS, RESPONSES, STOPPED):
        text = teacher_tok.apply_chat_template([{"role": "user", "content": prompt}],
                                               add_generation_prompt=True, tokenize=False)
        assert text.startswith("<|im_start|>user\n")
        prompt_ids = teacher_tok(text, add_special_tokens=False)["input_ids"]
        response_ids = list(response.encode("utf-8")) + ([teacher_tok.eos_token_id] if stopped else [])
        expected.append(float(_row_log_probs(plain, prompt_ids, response_ids, TEMPERATURE).sum()))
    assert torch.allclose(got.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-4)
    # the shaper: the sequence-level k1 at the last token, beside the reference's KL
    rollout.set(K.LOG_PROB, torch.where(rollout.get(K.RESPONSE_MASK), -1.5, 0.0))
    rollout.set(K.REF_LOG_PROB, rollout.get(K.LOG_PROB).clone())
    rollout.set(K.SCORE, torch.zeros(3))
    KLRewardShaper(FixedKLController(0.1), teacher_coef=0.25)(rollout)
    mask = rollout.get(K.RESPONSE_MASK)
    reward = rollout.get(K.REWARD).squeeze(-1)
    for i in range(3):
        n = int(mask[i].sum())
        seq_kl = -1.5 * n - expected[i]
        assert math.isclose(float(reward[i, n - 1]), -0.25 * seq_kl, rel_tol=1e-5, abs_tol=1e-5)
        assert torch.all(reward[i, : n - 1] == 0) and torch.all(reward[i, n:] == 0)
    # the prompt text as the policy read it, where the rollout holds no conversations
    as_text = TextTeacherLogProbs(model, teacher_tok, temperature=TEMPERATURE, use_messages=False)
    assert as_text.prompt_texts(rollout) == rollout.get(K.PROMPT_TEXT).tolist()


def test_text_mapping_refuses_multi_turn_episodes(tokenizer, byte_teacher_dir):
    from rlhf_torchrl.modules import load_tokenizer

    teacher_tok = load_tokenizer(byte_teacher_dir)
    teacher = TextTeacherLogProbs(load_teacher(byte_teacher_dir, teacher_tok), teacher_tok)
    rollout = probe_rollout(PROMPTS, tokenizer, RESPONSES, stopped=STOPPED, multi_turn=True)
    observed = rollout.get(K.OBSERVATION_MASK).clone()
    observed[0, 0] = True
    rollout.set(K.OBSERVATION_MASK, observed)
    with pytest.raises(ConfigError, match="reads single responses"):
        teacher(rollout)


# ---- the recipe ----------------------------------------------------------------------------------

def _train(cfg):
    sys.path.insert(0, str(ROOT / "recipes"))
    import ppo

    return ppo.train(cfg)


def _metrics(path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_recipe_distils_a_saved_policy_into_a_student(tmp_path, tiny_llama_dir, teacher_dir,
                                                      byte_teacher_dir):
    """A teacher run saves its policy (logging.save_model=true); a student from the tiny Llama
    then trains on that folder as reward.teacher alone (no reward function), with GAE: the
    teacher's KL is logged, in the reward, and the student's weights move. The text mapping
    (a byte-level teacher) runs too, one iteration."""
    from transformers import AutoModelForCausalLM

    teacher_run = tmp_path / "teacher"
    _train(_cfg(teacher_run, f"model.policy={teacher_dir}", "ppo.num_iterations=1",
                "logging.save_model=true"))
    saved = teacher_run / "policy"
    assert (saved / "config.json").is_file()

    student = tmp_path / "student"
    _train(_cfg(student, f"model.policy={tiny_llama_dir}", f"reward.teacher={saved}",
                "reward.functions=[]", "reward.teacher_coef=1.0", "ppo.kl_coef=0.0",
                "logging.save_model=true"))
    rows = _metrics(student)
    assert len(rows) == 2
    for row in rows:
        for name in ("objective/teacher_kl", "objective/non_score_reward", "loss/policy_avg",
                     "loss/value_avg"):
            assert math.isfinite(row[name]), name
        assert row["objective/scores"] == 0.0  # no score: the teacher alone teaches
        assert row["objective/teacher_kl"] != 0.0
        # ppo.kl_coef=0: the KL part of the reward is the teacher's alone
        assert math.isclose(row["objective/non_score_reward"], -row["objective/teacher_kl"],
                            rel_tol=1e-4, abs_tol=1e-6)
    before = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).state_dict()
    after = AutoModelForCausalLM.from_pretrained(student / "policy").state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)

    text = tmp_path / "text"
    _train(_cfg(text, f"model.policy={tiny_llama_dir}", f"reward.teacher={byte_teacher_dir}",
                "reward.teacher_mapping=text", "ppo.num_iterations=1", "logging.save_model=false"))
    (row,) = _metrics(text)
    assert math.isfinite(row["objective/teacher_kl"]) and row["objective/teacher_kl"] != 0.0
    assert math.isfinite(row["objective/scores"])  # VADER beside the teacher


def test_the_measurement_commands_pass_the_checks(tmp_path, capsys):
    """rlhf-torchrl bench distillation's runs (--dry-run prints them): the teacher first (the
    reward arm's seed 0, its policy saved), then each run; each composes and passes the start-up
    checks, the teacher arm's on the teacher's saved policy folder."""
    import shlex

    from rlhf_torchrl.benchmarks import distillation
    from rlhf_torchrl.config import checks, compose

    assert distillation.main(["--seeds", "0", "1", "2", "--runs", str(tmp_path), "--dry-run"]) == {}
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6
    teacher = tmp_path / "sentiment_gae_reward_0" / "policy"
    for i, line in enumerate(lines):
        overrides = [w for w in shlex.split(line) if not w.startswith("hydra.")]
        cfg = compose(overrides)
        checks.check_config(cfg)
        assert cfg.logging.save_model == (i == 0)
        if cfg.reward.teacher:
            assert cfg.reward.teacher == str(teacher)
            assert list(cfg.reward.function_weights) == [0.0] and cfg.ppo.kl_coef == 0.0
    assert [compose([w for w in shlex.split(line) if not w.startswith("hydra.")]).reward.teacher
            for line in lines].count(str(teacher)) == 3
