"""Benchmarks: ``rlhf-torchrl bench <name> [options]`` (the same as ``python -m
rlhf_torchrl.benchmarks.<name>``). Each prints a table of figures (tokens/s, seconds per
iteration, peak memory); ``--out PATH`` also writes them as JSON, and their plot beside it (PNG);
``rlhf-torchrl bench compare A.json B.json`` puts two runs side by side. ``--help`` shows every option's
default. ``benchmarks/README.md`` in the repository says what each measures, with dated figures.
"""

#: name -> what it measures (``rlhf-torchrl bench --help``)
BENCHMARKS = {
    "ppo_iteration": "seconds per PPO iteration by phase, next to bare model calls (the floor)",
    "collectors": "response tokens/s of the TorchRL collector against a raw generate",
    "backends": "tokens/s of the transformers and vLLM backends, and the seconds of a weight push",
    "scaling": "the recipe under bf16, LoRA, a token budget, torchrun, vLLM, overlap, Ray ...",
    "vs_trl": "side by side with TRL's PPOTrainer at identical settings (installs TRL in a venv)",
    "gpu_suite": "every CUDA path in one table (needs a CUDA GPU)",
    "real_sizes": "Qwen2.5-0.5B/1.5B shapes at verl's quickstart settings, their floor and verl's step (a CUDA GPU)",
    "plan_check": "rlhf-torchrl plan's peak memory and seconds per phase against measured runs on this CPU, three sizes",
    "estimators": "PPO (GAE) against GRPO, RLOO and REINFORCE++ on a task, seeds x estimators full runs, then their table",
    "estimators_table": "the table of the estimators runs (held-out result, KL, distinct-2, s/iteration, peak RSS)",
    "process_rewards": "arithmetic: outcome reward alone against outcome + per-step verifier, seeds x arms full runs, their table and held-out curves",
    "judge_sentiment": "sentiment: a language-model judge against VADER, each trained on with the other logged, seeds x arms full runs, their table and held-out samples with both scores",
    "distillation": "sentiment: a fresh student taught by a PPO-trained teacher (on-policy distillation) against PPO on the reward alone, seeds x arms full runs, their table and held-out curves",
    "overlong": "arithmetic: PPO with and without DAPO's overlong shaping at a length limit that cuts answers, seeds x arms full runs, their table (held-out share cut, accuracy, length) and curves",
    "data_loading": "start-up time and peak memory of a prompt set by form and size (10k-1M rows)",
    "reward_server": "a served reward model under N concurrent clients: p50/p99 latency, throughput",
    "partial_rollout": "partial rollouts against whole responses of widely varying lengths: s/iteration, tokens/s",
    "balance": "distributed.balance: the update on 2 torchrun processes, rows balanced by tokens against equal slices, on ragged responses",
    "soak": "the ppo command for 3,000 iterations (evaluations and checkpoints every 100), SIGKILLed midway and resumed: s/iteration and RSS, flat?",
    "compare": "the figures two or more --out files share, side by side with ratios (--plot draws them)",
}
