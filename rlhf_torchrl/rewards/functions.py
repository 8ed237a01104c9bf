"""Ready-made reward functions (``fn(prompts, responses) -> list[float]``)."""

from __future__ import annotations

import re
from functools import cache, lru_cache

from rlhf_torchrl.errors import MissingDependencyError


@lru_cache(maxsize=1)
def _vader():
    try:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
    except ImportError as e:
        raise MissingDependencyError("vader_sentiment needs vaderSentiment: `pip install vaderSentiment`.") from e
    return SentimentIntensityAnalyzer()


def vader_sentiment(prompts: list[str], responses: list[str]) -> list[float]:
    """VADER compound sentiment of each response, in [-1, 1] (rule-based, ~27k texts/s).

    Args:
        prompts: the rendered prompts (unused).
        responses: the decoded responses.
    """
    analyzer = _vader()
    return [analyzer.polarity_scores(r)["compound"] for r in responses]


# ---- verifiable math answers (GSM8K) -------------------------------------------------------------
_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def _to_number(text: str) -> float | None:
    cleaned = text.replace(",", "").replace("$", "").rstrip(".")
    try:
        return float(cleaned)
    except ValueError:
        return None


_ANSWER_MARKERS = ("####", "answer is", "answer:")


def _after_markers(text: str):
    """The text after the last occurrence of each answer marker present, in marker order."""
    lowered = text.lower()
    for marker in _ANSWER_MARKERS:
        at = lowered.rfind(marker)
        if at >= 0:
            yield text[at + len(marker):]


def extract_final_number(text: str) -> float | None:
    """The answer a solution ends with: the number after GSM8K's ``####`` marker if there is one,
    else after the last "answer is"/"answer:", else the last number in the text. Commas, a dollar
    sign and a trailing period are ignored; ``-3`` is negative. None when there is no number.

    Args:
        text: a solution.
    """
    for after in _after_markers(text):
        found = _NUMBER.search(after)
        if found:
            return _to_number(found.group())
    numbers = _NUMBER.findall(text)
    return _to_number(numbers[-1]) if numbers else None


def gsm8k_correct(prompts: list[str], responses: list[str], answer: list[str]) -> list[float]:
    """1.0 where the response's final number equals the row's ``answer`` (a GSM8K answer field,
    reasoning then ``#### 72``, or a bare number), else 0.0. Reads the dataset column ``answer``.
    Its attribute ``extract_answer`` (:func:`extract_final_number`) gives maj@k the answer it judges.

    Args:
        prompts: the rendered prompts (unused).
        responses: the decoded responses.
        answer: each row's ``answer`` column.
    """
    out = []
    for response, reference in zip(responses, answer):
        expected = extract_final_number(str(reference))
        got = extract_final_number(response)
        out.append(float(got is not None and expected is not None and abs(got - expected) < 1e-6))
    return out


# how maj@k reads the answer gsm8k_correct judges (rlhf_torchrl.trainers.evaluation.Evaluator)
gsm8k_correct.extract_answer = extract_final_number


def gsm8k_format(prompts: list[str], responses: list[str]) -> list[float]:
    """1.0 where the response states its answer in the asked format (``#### <number>``).

    Args:
        prompts: the rendered prompts (unused).
        responses: the decoded responses.
    """
    return [float(re.search(r"####\s*-?\$?\d", r) is not None) for r in responses]


# ---- per-step arithmetic (a process reward) -----------------------------------------------------
_NUM = r"-?\d+(?:\.\d+)?"
#: ``a op b [op c ...] = d``, the operators + - * / (and × ÷)
_EQUATION = re.compile(rf"({_NUM}(?:\s*[-+*/×÷]\s*{_NUM})+)\s*=\s*({_NUM})")
_TERM = re.compile(rf"\s*({_NUM})\s*([-+*/×÷]?)")


def evaluate_arithmetic(expression: str) -> float | None:
    """The value of ``a op b op c ...`` with + - * / (× ÷), multiplication and division first, left
    to right; None for a division by zero or text that is not such an expression.

    Args:
        expression: e.g. ``"2 + 3 * 4"`` (14.0).
    """
    numbers, ops, at = [], [], 0
    while at < len(expression):
        m = _TERM.match(expression, at)
        if m is None or m.end() == at:
            return None
        numbers.append(float(m.group(1)))
        if m.group(2):
            ops.append({"×": "*", "÷": "/"}.get(m.group(2), m.group(2)))
        at = m.end()
    if not numbers or len(ops) != len(numbers) - 1:
        return None
    terms, signs = [numbers[0]], []  # products and quotients first
    for op, n in zip(ops, numbers[1:]):
        if op in "*/":
            if op == "/" and n == 0:
                return None
            terms[-1] = terms[-1] * n if op == "*" else terms[-1] / n
        else:
            terms.append(n)
            signs.append(op)
    value = terms[0]
    for sign, term in zip(signs, terms[1:]):
        value = value + term if sign == "+" else value - term
    return value


def arithmetic_steps(prompts: list[str], responses: list[str],
                     steps: list[list[str]]) -> list[list[float]]:
    """A per-step verifier (a process reward): is each step's arithmetic right?

    Each step that states equations ``a op b ... = c`` (+ - * / × ÷, decimals, the usual
    precedence) is checked: ``+1 / m`` if every equation in it holds (within 1e-6), ``-1 / m`` if
    one does not, with ``m`` the response's steps that state an equation; a step without one
    (``#### 112``, prose) gets 0. A response's values sum to (right - wrong) / m, in [-1, 1]:
    more steps do not earn more. Use it beside an outcome reward (``gsm8k_correct``), which
    checks the final answer.

    Args:
        prompts: the rendered prompts (unused).
        responses: the decoded responses (unused: the steps are read).
        steps: each response's steps (``reward.step_delimiter``: one a line).

    Example:
        >>> arithmetic_steps([""], [""], [["12 + 7 = 19", "19 - 4 = 16", "#### 16"]])
        [[0.5, -0.5, 0.0]]
    """
    out = []
    for row in steps:
        verdicts = []
        for step in row:
            equations = _EQUATION.findall(step)
            if not equations:
                verdicts.append(None)
                continue
            right = True
            for left, result in equations:
                value = evaluate_arithmetic(left)
                right = right and value is not None and abs(value - float(result)) < 1e-6
            verdicts.append(right)
        m = sum(v is not None for v in verdicts)
        out.append([0.0 if v is None else (1.0 if v else -1.0) / m for v in verdicts])
    return out


# ---- reasoning-gym tasks (data.source=reasoning_gym:<task>) -------------------------------------
def extract_tagged_answer(text: str) -> str:
    """The answer a response gives: inside its last ``<answer>...</answer>`` (reasoning-gym's
    convention), else after its last ``####`` / "answer is" / "answer:" up to the end of that line,
    else its last non-empty line; stripped, a trailing period dropped.

    Args:
        text: a response.
    """
    tagged = re.findall(r"<answer>(.*?)</answer>", text, flags=re.DOTALL)
    if tagged:
        return tagged[-1].strip()
    for after in _after_markers(text):
        return after.strip().split("\n")[0].strip().rstrip(".").strip()
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1].rstrip(".").strip() if lines else ""


@cache
def _reasoning_gym_checker(task: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)  # builds a dataset: once per task


def reasoning_gym_score(prompts: list[str], responses: list[str], answer: list[str],
                        metadata: list[dict]) -> list[float]:
    """The task's own checker (``reasoning_gym.get_score_answer_fn``) on the answer each response
    gives (:func:`extract_tagged_answer`): 1.0 correct, 0.0 wrong, some tasks give partial credit.
    Reads the ``answer`` and ``metadata`` columns of a ``reasoning_gym:<task>`` prompt set (the
    checkers do not read the question; the rendered prompt stands in for it). Its attribute
    ``extract_answer`` (:func:`extract_tagged_answer`) gives maj@k the answer it judges.

    Args:
        prompts: the rendered prompts (given to the checker as the question).
        responses: the decoded responses.
        answer: each row's ``answer`` column.
        metadata: each row's ``metadata`` column.
    """
    out = []
    for prompt, response, a, meta in zip(prompts, responses, answer, metadata):
        check = _reasoning_gym_checker(meta["source_dataset"])
        entry = {"question": prompt, "answer": a, "metadata": meta}
        out.append(float(check(extract_tagged_answer(response), entry)))
    return out


# how maj@k reads the answer reasoning_gym_score judges
reasoning_gym_score.extract_answer = extract_tagged_answer
