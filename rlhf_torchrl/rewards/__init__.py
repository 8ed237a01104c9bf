"""Rewards: each response's score.

``scoring``: the scorer that combines reward models and functions; ``reward_model``: a sequence
classifier as a reward; ``functions``: ready-made reward functions; ``remote``: rewards scored by a
service over HTTP; ``server``: a reward model served over HTTP; ``training``: reward-model training
on preference pairs.
"""
