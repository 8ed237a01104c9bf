"""Side by side with TRL's PPOTrainer (trl==1.12.0, ``trl.experimental.ppo``) at identical settings.

Same policy (``--model``: by default a tiny GPT-2, 2 layers, 128 wide), same tokenizer (with a
pass-through chat template so both sides see the same prompt tokens), same reward model and
value-model init (a tiny GPT-2 sequence classifier over that tokenizer), same prompts, batch size,
response length, PPO epochs, minibatches, learning rate, KL coefficient, fp32, same threads. TRL
runs in a virtual environment this command creates once (``--venv``: ``trl==1.12.0`` over this
interpreter's packages) so the project never depends on TRL. Runs alternate (TRL, ours, TRL, ours,
...) and the report gives median seconds per iteration after warm-up, their ratio, and both
reward curves.

    OMP_WAIT_POLICY=PASSIVE rlhf-torchrl bench vs_trl --batch-size 16
    OMP_WAIT_POLICY=PASSIVE rlhf-torchrl bench vs_trl --batch-size 64 --minibatches 4
"""

from __future__ import annotations

import argparse
import json
import os
import site
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from rlhf_torchrl.benchmarks.common import (
    BUILT,
    TOKENIZERS,
    add_out_arg,
    finish,
    load_policy,
    machine,
    make_parser,
)
from rlhf_torchrl.modules.models import _cache_root

TRL_VERSION = "1.12.0"
PASSTHROUGH = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def ensure_trl_venv(venv: Path) -> Path:
    """The python of a venv with ``trl==TRL_VERSION`` that sees this interpreter's packages
    (torch, transformers, this package, an editable install too); created on first use."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", f"import trl, sys; sys.exit(trl.__version__ != {TRL_VERSION!r})"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"creating {venv} with trl=={TRL_VERSION} (once)", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # this interpreter's site folders after the venv's own (their .pth files processed: an editable
    # install's finder too): TRL goes into the venv, everything else is shared. Not
    # --system-site-packages: where this interpreter is itself a venv, that would skip its packages.
    site_dirs = [*site.getsitepackages(), site.getusersitepackages(),
                 sysconfig.get_paths()["purelib"]]
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip()
    line = "import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dict.fromkeys(site_dirs))
    Path(purelib, "_rlhf_torchrl_parent.pth").write_text(line + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", f"trl=={TRL_VERSION}"], check=True)
    return python


def make_fixture(path: Path, args) -> None:
    """Policy, reward model and tokenizer directories, and a prompt file, shared by both sides."""
    import torch
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from rlhf_torchrl.data import load_prompts

    tok, policy = load_policy(args.model, args.tokenizer, args.seed)
    tok.chat_template = PASSTHROUGH
    if args.model not in BUILT:  # (a built policy was seeded: the reward model's init follows it)
        torch.manual_seed(args.seed)
    rm = GPT2Config(vocab_size=len(tok), n_embd=128, n_layer=2, n_head=4, n_positions=1024,
                    bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                    summary_first_dropout=0.0, num_labels=1)
    policy.save_pretrained(path / "policy")
    GPT2ForSequenceClassification(rm).save_pretrained(path / "rm")
    for sub in ("policy", "rm"):
        tok.save_pretrained(path / sub)
    prompts = load_prompts("polarity", template="Continue this movie review: {prompt}", max_words=8)
    with open(path / "prompts.jsonl", "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p.text}) + "\n")


def run_worker(python: str, side: str, fixture: Path, args, out: Path) -> dict:
    cmd = [python, "-m", "rlhf_torchrl.benchmarks.vs_trl", "--worker", side, "--fixture", str(fixture),
           "--worker-out", str(out), *args.passthrough]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{side} worker failed:\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


# --------------------------------------------------------------------------------------------
# workers: each runs warmup + iterations PPO iterations and records per-iteration seconds/score


def worker_trl(a, fixture: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        TrainerCallback,
    )
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    torch.set_num_threads(a.threads)
    if a.trl_reuse_freed_memory:
        from rlhf_torchrl.runtime import reuse_freed_memory

        reuse_freed_memory()
    tok = AutoTokenizer.from_pretrained(fixture / "policy")
    tok.padding_side = "left"
    prompts = [json.loads(x)["prompt"] for x in open(fixture / "prompts.jsonl")]
    ds = Dataset.from_dict({"input_ids": [tok(p, add_special_tokens=False)["input_ids"]
                                          for p in prompts]})
    n = a.warmup + a.iterations
    per_device = a.batch_size // a.minibatches
    config = PPOConfig(
        output_dir=tempfile.mkdtemp(dir=fixture), per_device_train_batch_size=per_device,
        gradient_accumulation_steps=a.minibatches, num_mini_batches=a.minibatches,
        num_ppo_epochs=a.epochs, total_episodes=a.batch_size * n, response_length=a.response_length,
        temperature=a.temperature, learning_rate=a.lr, kl_coef=0.05, stop_token="eos",
        num_sample_generations=0, report_to=[], logging_steps=1, save_strategy="no",
        use_cpu=True, bf16=False, fp16=False, seed=a.seed, local_rollout_forward_batch_size=64,
        lr_scheduler_type="linear", max_grad_norm=1.0,
    )
    policy = AutoModelForCausalLM.from_pretrained(fixture / "policy")
    ref = AutoModelForCausalLM.from_pretrained(fixture / "policy")
    rm = AutoModelForSequenceClassification.from_pretrained(fixture / "rm", num_labels=1)
    vm = AutoModelForSequenceClassification.from_pretrained(fixture / "rm", num_labels=1)
    stamps, scores = [], []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "objective/scores" in logs:
                scores.append(float(logs["objective/scores"]))

    trainer = PPOTrainer(args=config, processing_class=tok, model=policy, ref_model=ref,
                         reward_model=rm, train_dataset=ds, value_model=vm, callbacks=[Clock()])
    start = time.perf_counter()
    trainer.train()
    seconds = [b - a_ for a_, b in zip([start, *stamps[:-1]], stamps)]
    return {"seconds": seconds, "scores": scores}


def worker_ours(a, fixture: Path) -> dict:
    import torch

    from rlhf_torchrl.config import builders, compose

    torch.set_num_threads(a.threads)
    overrides = [
        "task=custom", "eval.every=0", "checkpoint.every=0",  # TRL: a fixed KL, no held-out eval
        f"output_dir={tempfile.mkdtemp(dir=fixture)}", f"model.policy={fixture / 'policy'}",
        f"reward.model={fixture / 'rm'}", "reward.functions=[]", "value_model.init=reward_model",
        f"data.source={fixture / 'prompts.jsonl'}", "data.template='{prompt}'", "data.max_words=null",
        "data.system_prompt=null", f"ppo.batch_size={a.batch_size}",
        f"ppo.num_mini_batches={a.minibatches}", f"ppo.num_ppo_epochs={a.epochs}",
        f"ppo.num_iterations={a.warmup + a.iterations}", "ppo.forward_batch_size=64",
        f"generation.max_new_tokens={a.response_length}", f"generation.temperature={a.temperature}",
        f"optim.lr={a.lr}", "optim.value_head_lr=null", "ppo.kl_coef=0.05",
        "logging.progress_bar=false", "logging.save_model=false", "logging.logger=null",
        "model.autocast=null", f"seed={a.seed}",  # fp32 on both sides
        *a.ours,
    ]
    cfg = compose(overrides)
    builders.train(cfg)
    rows = [json.loads(x) for x in open(Path(cfg.output_dir) / "metrics.jsonl")]
    phases = {k.split("/")[1]: statistics.median(r[k] for r in rows[a.warmup:])
              for k in rows[0] if k.startswith("time/")}
    phases["update_floor"] = update_floor(a, fixture)
    phases["update_floor_unfused"] = update_floor(a, fixture, fused=False)
    return {"seconds": [r["time/total"] for r in rows], "scores": [r["objective/scores"] for r in rows],
            "phases": phases}


def update_floor(a, fixture: Path, repeats: int = 5, fused: bool = True) -> float:
    """Median seconds of the update's compute floor: per minibatch, one forward and backward of
    the policy (LM head on the response positions) and of the critic (trunk and value head), and
    one fused AdamW step over both, as loaded here (the same kernels as the run), on rows of the
    prompt set's own lengths plus the full response length, with no framework around them.
    ``fused=False``: the models' own activation modules (GPT-2's ``gelu_new``, as TRL runs it)."""
    import random

    import torch
    from transformers.activations import NewGELUActivation

    from rlhf_torchrl.modules import load_causal_lm, load_tokenizer
    from rlhf_torchrl.modules.critic import make_critic

    tok = load_tokenizer(str(fixture / "policy"))
    policy = load_causal_lm(str(fixture / "policy"), tok).train()
    critic = make_critic(policy=policy, tokenizer=tok, init="reward_model",
                         name_or_path=str(fixture / "rm")).train()
    for module in [] if fused else [*policy.modules(), *critic.modules()]:
        if isinstance(getattr(module, "act", None), torch.nn.GELU):  # GPT-2's MLP, fused back
            module.act = NewGELUActivation()  # as transformers builds it
    params = [*policy.parameters(), *critic.parameters()]
    optimizer = torch.optim.AdamW(params, lr=0.0, fused=True)  # the cost of a step, no change
    lengths = [len(tok(json.loads(x)["prompt"], add_special_tokens=False)["input_ids"])
               for x in open(fixture / "prompts.jsonl")]
    rng, R, rows = random.Random(a.seed), a.response_length, a.batch_size // a.minibatches
    backbone, head = critic.backbone, critic.head

    def update():
        for _ in range(a.epochs * a.minibatches):
            P = max(rng.sample(lengths, rows))
            ids = torch.randint(0, len(tok), (rows, P + R))
            optimizer.zero_grad(set_to_none=True)
            hidden = policy.base_model(ids).last_hidden_state[:, P - 1:-1]
            logits = policy.get_output_embeddings()(hidden).float()
            log_probs = logits.log_softmax(-1).gather(-1, ids[:, P:, None])
            values = head(backbone(ids).last_hidden_state[:, P - 1:-1])
            (log_probs.sum() + values.sum()).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()

    update()  # warm-up
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        update()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


# --------------------------------------------------------------------------------------------


def main(argv=None) -> dict | None:
    parser = make_parser(__doc__)
    parser.add_argument("--model", default="tiny-gpt2",
                        help="the policy: a preset (tiny-gpt2, tiny-llama, smollm2, "
                             "qwen2-0.5b-shape), a local model directory or a hub id")
    parser.add_argument("--tokenizer", choices=TOKENIZERS, default="auto",
                        help="for the built presets: bytes or smollm2 (SmolLM2's 49k, as the "
                             "figures in benchmarks/README.md)")
    parser.add_argument("--batch-size", type=int, default=16, help="responses per iteration")
    parser.add_argument("--minibatches", type=int, default=1, help="minibatches per epoch")
    parser.add_argument("--epochs", type=int, default=4, help="PPO epochs per iteration")
    parser.add_argument("--response-length", type=int, default=32, help="max new tokens")
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature")
    parser.add_argument("--lr", type=float, default=1e-5, help="learning rate (both sides)")
    parser.add_argument("--iterations", type=int, default=8, help="timed iterations per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations first")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs per side")
    parser.add_argument("--threads", type=int, default=2, help="torch's CPU threads")
    parser.add_argument("--seed", type=int, default=0, help="weights, prompts and sampling")
    parser.add_argument("--trl-reuse-freed-memory", action="store_true",
                        help="give TRL's process the allocator setting our recipe uses by default")
    parser.add_argument("--venv", default=str(_cache_root() / f"venv-trl-{TRL_VERSION}"),
                        help="TRL's virtual environment, created here on first use "
                             "(RLHF_TORCHRL_CACHE moves the default)")
    parser.add_argument("--ours", nargs="*", default=[], metavar="OVERRIDE",
                        help="recipe overrides for this package's side only, e.g. "
                             "model.packing=true model.compile=true (TRL has neither)")
    add_out_arg(parser)
    parser.add_argument("--worker", choices=("trl", "ours"), help=argparse.SUPPRESS)
    parser.add_argument("--fixture", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.worker:
        result = (worker_trl if a.worker == "trl" else worker_ours)(a, Path(a.fixture))
        Path(a.worker_out).write_text(json.dumps(result))
        return None
    a.passthrough = [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
                     if k in ("batch_size", "minibatches", "epochs", "response_length",
                              "temperature", "lr", "iterations", "warmup", "threads", "seed")]
    if a.trl_reuse_freed_memory:
        a.passthrough.append("--trl-reuse-freed-memory")
    if a.ours:
        a.passthrough += ["--ours", *a.ours]
    trl_python = str(ensure_trl_venv(Path(a.venv)))
    runs = {"trl": [], "ours": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        make_fixture(tmp, a)
        for r in range(a.rounds):
            for side, python in (("trl", trl_python), ("ours", sys.executable)):
                res = run_worker(python, side, tmp, a, tmp / f"{side}{r}.json")
                runs[side].append(res)
                steady = res["seconds"][a.warmup:]
                print(f"round {r} {side:>4}: median {statistics.median(steady):.3f} s/iteration "
                      f"over {len(steady)} iterations", flush=True)
    med = {side: statistics.median(s for res in rs for s in res["seconds"][a.warmup:])
           for side, rs in runs.items()}
    print(f"\nPPO iteration, {a.model}, batch {a.batch_size}, response {a.response_length}, "
          f"{a.epochs} epochs x {a.minibatches} minibatches, {a.threads} threads, "
          f"{a.rounds} alternating runs each" + (f"; ours with {' '.join(a.ours)}" if a.ours else ""))
    malloc = " (with reuse_freed_memory)" if a.trl_reuse_freed_memory else ""
    print(f"  TRL {TRL_VERSION} PPOTrainer{malloc}: {med['trl']:.3f} s/iteration (median)")
    print(f"  rlhf_torchrl:            {med['ours']:.3f} s/iteration (median)")
    print(f"  ours / TRL = {med['ours'] / med['trl']:.2f}  (TRL is {med['trl'] / med['ours']:.2f}x our time)")
    phases = runs["ours"][-1]["phases"]
    print("  our phases (s, median, last run): " + ", ".join(
        f"{k} {v:.3f}" for k, v in phases.items()
        if k not in ("tokens_per_second", "update_floor", "update_floor_unfused")))
    floor, unfused = (statistics.median(res["phases"][k] for res in runs["ours"])
                      for k in ("update_floor", "update_floor_unfused"))
    print(f"  the update's compute floor (bare forwards, backwards and fused AdamW steps of the "
          f"policy and critic, same shapes): {floor:.3f} s, our update {phases['update'] / floor:.2f}x "
          f"it; {unfused:.3f} s with the models' own activations (as TRL runs them). 2x TRL would "
          f"be {med['trl'] / 2:.3f} s an iteration")
    for side in ("trl", "ours"):
        curve = [round(x, 3) for x in runs[side][0]["scores"]]
        print(f"  reward curve ({side}, run 0): {curve}")
    result = {"args": {k: v for k, v in vars(a).items() if k != "passthrough"},
              "machine": machine(), "median_seconds": med,
              "ratio_ours_over_trl": med["ours"] / med["trl"], "runs": runs}
    return finish(a, result, "vs_trl")


if __name__ == "__main__":
    main()
