"""Recording a run: ``metrics`` (per-iteration statistics), ``trackers`` (TorchRL's loggers),
``run_log`` (the metrics file and progress lines) and ``report`` (the run's HTML report).
"""
