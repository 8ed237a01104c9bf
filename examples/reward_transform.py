"""A reward transform of your own, a TorchRL ``Transform``, in the trainer's pipeline.

The transform reads each scored rollout and reshapes its "score": here a length penalty that
subtracts ``coef`` per response token beyond a budget (answers that ramble pay for it). The same
class works appended to a TorchRL env (``_call``) and as the trainer's ``reward_transform``
(``forward``), which runs right after the scorer, before the old log-probs and advantages.

    python examples/reward_transform.py                        # the sentiment task
    python examples/reward_transform.py ppo.num_iterations=5 output_dir=outputs/brief
"""

import sys

from torchrl.envs import Transform

from rlhf_torchrl import keys as K
from rlhf_torchrl.config import builders, compose


class LengthPenalty(Transform):
    """``score -= coef * max(0, response tokens - budget)``; the score before it stays in
    ``"score_before_length_penalty"`` for the logs."""

    def __init__(self, budget: int, coef: float = 0.01):
        super().__init__(in_keys=[K.SCORE, K.RESPONSE_MASK], out_keys=[K.SCORE])
        self.budget, self.coef = budget, coef

    def _call(self, td):
        length = td.get(K.RESPONSE_MASK).sum(-1)
        score = td.get(K.SCORE)
        td.set("score_before_length_penalty", score)
        td.set(K.SCORE, score - self.coef * (length - self.budget).clamp_min(0))
        return td

    forward = _call  # outside an env (the trainer, a replay buffer): the whole TensorDict


if __name__ == "__main__":
    cfg = compose(["task=sentiment", "output_dir=outputs/reward_transform", *sys.argv[1:]])
    trainer = builders.build_trainer(cfg, reward_transform=LengthPenalty(budget=16, coef=0.02))
    def penalty(batch):  # logged with the iteration's metrics
        paid = batch["score"] - batch["score_before_length_penalty"]
        return {"objective/length_penalty": float(paid.mean())}

    trainer.register_op("post_steps_log", penalty)
    trainer.fit()
