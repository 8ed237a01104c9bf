"""Trainers: the PPO iteration and everything it runs.

``ppo``: :class:`~rlhf_torchrl.trainers.ppo.PPOTrainer`; ``stages`` and ``hooks``: where and what
attaches to its loop; ``update`` and ``micro_batches``: the update over a rollout; ``optim``: the
optimisers; ``guards``: divergence guards; ``checkpoint``: checkpoints and exact resume;
``warm_start``: a critic warm-started from another run; ``export``: a checkpoint's policy as a
Hugging Face model directory; ``evaluation``: held-out evaluation.
"""
