"""Ready-made reward functions (``fn(prompts, responses) -> list[float]``)."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def _vader():
    try:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
    except ImportError as e:
        raise ImportError("vader_sentiment needs vaderSentiment: `pip install vaderSentiment`.") from e
    return SentimentIntensityAnalyzer()


def vader_sentiment(prompts: list[str], responses: list[str]) -> list[float]:
    """VADER compound sentiment of each response, in [-1, 1] (rule-based, ~27k texts/s)."""
    analyzer = _vader()
    return [analyzer.polarity_scores(r)["compound"] for r in responses]
