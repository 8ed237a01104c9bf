"""Tools a policy may call in a multi-turn episode: built-ins, user functions, and their execution.

A tool is a Python callable taking keyword arguments and returning what the policy reads back
(anything ``str()`` turns into text), or a :class:`ToolResult` that also carries a per-turn reward
or ends the episode. ``env.tools`` names them: the built-ins ``calculator`` (arithmetic
expressions, evaluated from their syntax tree: no code runs) and ``python`` (the policy's
program, run in an operating-system sandbox: :mod:`rlhf_torchrl.envs.sandbox`), or any function by
dotted path (``my_pkg.tools.lookup``), as reward functions are named.

Calls are written in the assistant's text as TorchRL's ``XMLBlockParser`` reads them::

    <tool name="calculator">66 + 46</tool>
    <tool name="lookup">{"key": "capital of France"}</tool>

A JSON object body gives the keyword arguments; any other body is passed as the tool's single
argument. :func:`run_tool` never raises for what a tool does: an unknown tool, bad arguments, an
exception or a timeout come back as a :class:`ToolResult` with ``ok=False`` whose text says so,
and the episode goes on.
"""

from __future__ import annotations

import ast
import concurrent.futures
import contextvars
import inspect
import json
import math
import operator
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from rlhf_torchrl.envs.sandbox import SandboxSpec
from rlhf_torchrl.errors import ConfigError

#: the longest tool output the policy reads back (longer ones are cut, saying so)
MAX_OUTPUT_CHARS = 1000


@dataclass
class ToolResult:
    """What a tool call gives back.

    Args:
        content: the tool message's text.
        ok: whether the call succeeded.
        reward: a per-turn reward, added at the last token of the turn that made the call (None:
            none).
        stop: end the episode after this turn.
    """

    content: str
    ok: bool = True
    reward: float | None = None
    stop: bool = False


@dataclass
class ToolCall:
    """One call parsed from an assistant turn.

    Args:
        name: the tool's name.
        arguments: a dict of keyword arguments, or the raw text of a body that is not a JSON
            object.
    """

    name: str
    arguments: dict | str


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls in an assistant turn, in order, with TorchRL's ``XMLBlockParser``.

    Args:
        text: the assistant turn's text.
    """
    from torchrl.envs.llm.transforms import XMLBlockParser

    calls = []
    for call in XMLBlockParser()(text)["calls"]:
        args = call.args
        if isinstance(args, str):  # a JSON string: its text is the argument
            pass
        elif not isinstance(args, dict):  # a JSON number, list, ... (the parser passes it on as
            args = json.dumps(args)        # is, tests/test_torchrl_upstream.py): its text
        elif set(args) == {"raw"}:  # a body that is not JSON: the tool's single argument
            args = args["raw"]
        calls.append(ToolCall(call.tool, args))
    return calls


# ---- built-in tools -----------------------------------------------------------------------------
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, ``+ - * / // % **`` and parentheses.

    Evaluated from the expression's syntax tree, so nothing but arithmetic can run; exponents
    are capped (``|e| <= 64``) and so is the length (200 characters). Whole results print as integers
    (``"112"``), others with up to 12 significant digits.

    Args:
        expression: the arithmetic expression.
    """
    expression = str(expression).strip().rstrip("=").strip()
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.12g}"


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
            raise ValueError("exponent too large")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("result is not a finite number")
        return value
    raise ValueError(f"only numbers and + - * / // % ** are allowed, not {type(node).__name__}")


class PythonTool:
    """Run Python code in a sandbox and return what it printed (stdout and stderr).

    The policy's program is untrusted: it runs where ``sandbox`` says (``docs/security.md``). The
    policy sends only ``code``: a call that also names limits (``{"code": ..., "timeout": 600}``) is
    refused, as any unknown argument is. A Markdown code fence (three backticks) around the code is
    removed. Building it raises :class:`~rlhf_torchrl.errors.ConfigError` where the sandbox cannot
    run here.

    Args:
        sandbox: the ``env.python_*`` settings (None: a bubblewrap sandbox with no network, no
            view of the trainer's files or processes, and limits on processes, time, memory and
            output).

    Example::

        >>> PythonTool(SandboxSpec(timeout=5.0))("print(6 * 7)").content
        '42'
    """

    def __init__(self, sandbox: SandboxSpec | None = None):
        from rlhf_torchrl.envs.sandbox import make_sandbox

        self.spec = sandbox or SandboxSpec()
        self.sandbox = make_sandbox(self.spec)

    def __call__(self, code: str) -> ToolResult:
        deadline = TOOL_DEADLINE.get()  # run_tool's: the sandbox stops by then
        left = None if deadline is None else max(0.0, deadline[0] - time.monotonic())
        run = self.sandbox.run(_strip_fence(str(code)), timeout=left)
        if run.end == "exit" and run.returncode == 0:
            return ToolResult(run.output or "(no output)")
        limit = self.spec.timeout if deadline is None else min(self.spec.timeout, deadline[1])
        reason = {
            "timeout": f"ran longer than {limit:g} s and was stopped",
            "output_limit": f"printed more than {self.spec.max_output_bytes} bytes and was stopped",
            "error": f"could not run: {run.message}",
        }.get(run.end) or _EXIT_REASONS.get(run.returncode, f"exited with status {run.returncode}")
        return ToolResult(f"Error: the code {reason}.\n{run.output}".strip(), ok=False)


_EXIT_REASONS = {-9: "was killed (CPU time or memory limit)", -24: "ran out of CPU time"}


def _strip_fence(code: str) -> str:
    text = code.strip()
    if text.startswith("```"):
        text = text.split("\n", 1)[1] if "\n" in text else ""
        text = text.rsplit("```", 1)[0]
    return text


#: the built-in tools' names: ``calculator`` (:func:`calculator`), ``python`` (:class:`PythonTool`)
BUILTIN_TOOLS = ("calculator", "python")


def load_tools(names: Sequence[str], *, python_sandbox: SandboxSpec | None = None) -> dict[str, Callable]:
    """The tools ``env.tools`` names: a built-in (:data:`BUILTIN_TOOLS`) or a dotted path to a
    function (``my_pkg.tools.lookup`` or ``./my_tools.py:lookup``, called by its last
    component: ``lookup``). Where the ``python`` tool's sandbox cannot run here, a
    :class:`~rlhf_torchrl.errors.ConfigError` says how to install one or opt out.

    Args:
        names: the tools' names or dotted paths.
        python_sandbox: where ``python`` runs its code (None: the default
            :class:`~rlhf_torchrl.envs.sandbox.SandboxSpec`).
    """
    from rlhf_torchrl.rewards.scoring import load_callable

    tools: dict[str, Callable] = {}
    for name in names:
        name = str(name)
        if name not in BUILTIN_TOOLS and "." not in name and ":" not in name:
            raise ConfigError(
                f"Unknown tool {name!r} in env.tools: the built-in tools are "
                f"{', '.join(BUILTIN_TOOLS)}; name a function of your own by its dotted path "
                "(my_pkg.tools.lookup) or its file (./my_tools.py:lookup).")
        fn = (calculator if name == "calculator" else PythonTool(python_sandbox) if name == "python"
              else load_callable(name, what="Tool"))
        key = name if name in BUILTIN_TOOLS else name.replace(":", ".").rsplit(".", 1)[-1]
        if key in tools:
            raise ConfigError(f"Two tools are called {key!r} (env.tools={list(names)}): rename one.")
        tools[key] = fn
    return tools


def describe_tools(tools: Mapping[str, Callable]) -> str:
    """A system-prompt paragraph naming each tool, its arguments and the call format.

    Args:
        tools: tool name to function (:func:`load_tools`).
    """
    lines = ["You can call tools. Write a call as <tool name=\"NAME\">ARGUMENTS</tool> and wait for "
             "its result; answer without a call when you are done. Tools:"]
    for name, fn in tools.items():
        params = ", ".join(inspect.signature(fn).parameters)
        doc = (inspect.getdoc(fn) or "").split("\n")[0]
        lines.append(f"- {name}({params}): {doc}")
    return "\n".join(lines)


#: when the tool call running in this context must have answered: ``(time.monotonic() deadline,
#: timeout in seconds)``, set by :func:`run_tool` from the config; the python tool stops by then
TOOL_DEADLINE: contextvars.ContextVar[tuple[float, float] | None] = contextvars.ContextVar(
    "tool_deadline", default=None)
#: seconds past its timeout that a call may take to report its own stop (the python tool's sandbox
#: is killed at the deadline and reaped before the call returns)
ANSWER_GRACE = 1.0


def run_tool(tools: Mapping[str, Callable], call: ToolCall, *, timeout: float = 10.0) -> ToolResult:
    """Call ``call.name`` with ``call.arguments``; whatever happens, a :class:`ToolResult`.

    A dict of arguments is passed as keywords, anything else as the single positional argument.
    Each call runs in a daemon thread of its own (a call that never returns cannot hold up
    other calls or the trainer's exit) with a deadline ``timeout`` seconds away
    (:data:`TOOL_DEADLINE`): the ``python`` tool stops its code by then. A call that has not
    answered :data:`ANSWER_GRACE` seconds after the deadline is abandoned (a user tool's thread is
    left to finish) and reported as timed out.

    Args:
        tools: tool name to function (:func:`load_tools`).
        call: the parsed call.
        timeout: seconds until the call's deadline.
    """
    fn = tools.get(call.name)
    if fn is None:
        return ToolResult(f"Error: there is no tool {call.name!r} (tools: {', '.join(tools)}).", ok=False)
    args, kwargs = ((), call.arguments) if isinstance(call.arguments, dict) else ((call.arguments,), {})
    future: concurrent.futures.Future = concurrent.futures.Future()
    context = contextvars.copy_context()
    context.run(TOOL_DEADLINE.set, (time.monotonic() + timeout, timeout))

    def call_tool():
        try:
            future.set_result(context.run(fn, *args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            future.set_exception(e)

    threading.Thread(target=call_tool, name=f"tool-{call.name}", daemon=True).start()
    try:
        out = future.result(timeout=timeout + ANSWER_GRACE)
    except concurrent.futures.TimeoutError:
        return ToolResult(f"Error: {call.name} did not answer within {timeout:g} s.", ok=False)
    except Exception as e:  # noqa: BLE001 - a tool's failure is the policy's observation
        return ToolResult(f"Error: {call.name} failed: {type(e).__name__}: {e}", ok=False)
    result = out if isinstance(out, ToolResult) else ToolResult(
        out if isinstance(out, str)
        else json.dumps(out, default=str) if isinstance(out, (dict, list)) else str(out))
    if len(result.content) > MAX_OUTPUT_CHARS:
        result.content = result.content[:MAX_OUTPUT_CHARS] + f"... [cut at {MAX_OUTPUT_CHARS} characters]"
    return result
