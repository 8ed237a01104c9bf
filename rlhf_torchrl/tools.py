"""Tools a policy may call in a multi-turn episode: built-ins, user functions, and their execution.

A tool is a Python callable taking keyword arguments and returning what the policy reads back
(anything ``str()`` turns into text), or a :class:`ToolResult` that also carries a per-turn reward
or ends the episode. ``env.tools`` names them: the built-ins ``calculator`` (arithmetic
expressions, evaluated from their syntax tree: no code runs) and ``python`` (a sandboxed
interpreter: its own process with CPU-time, wall-clock, memory and file-size limits, no network,
no subprocesses), or any function by dotted path (``my_pkg.tools.lookup``), as reward functions
are named.

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
import inspect
import json
import math
import operator
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .errors import ConfigError

#: the longest tool output the policy reads back (longer ones are cut, saying so)
MAX_OUTPUT_CHARS = 1000


@dataclass
class ToolResult:
    """What a tool call gives back: ``content`` (the tool message's text), whether it succeeded,
    an optional per-turn ``reward`` (added at the last token of the turn that made the call),
    and ``stop`` (end the episode after this turn)."""

    content: str
    ok: bool = True
    reward: float | None = None
    stop: bool = False


@dataclass
class ToolCall:
    """One call parsed from an assistant turn: the tool's name and its arguments (a dict of
    keyword arguments, or the raw text of a body that is not a JSON object)."""

    name: str
    arguments: dict | str


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls in an assistant turn, in order, with TorchRL's ``XMLBlockParser``."""
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


# the sandbox's first statements, run before the policy's code in the child process: no network,
# no new processes, no native libraries (the interpreter's audit hook cannot be removed)
_SANDBOX = r"""
import resource, sys
cpu, memory, files = (int(a) for a in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (files, files))
_BLOCKED = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
            "os.fork", "os.forkpty", "pty.", "ctypes.", "os.kill", "os.killpg")
def _guard(event, args):
    if event.startswith(_BLOCKED):
        raise PermissionError(f"the python tool's sandbox forbids {event}")
sys.addaudithook(_guard)
del _guard
code = sys.stdin.read()
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
"""


def python(code: str, *, timeout: float = 5.0, memory_mb: int = 512) -> ToolResult:
    """Run Python ``code`` in a sandbox and return what it printed (stdout, then stderr).

    The code runs in a new interpreter (``python -I``: no user site, no environment variables,
    a fresh temporary working directory) with limits on CPU time (``timeout``), wall-clock time
    (``timeout`` + 1 s, then the process group is killed), address space (``memory_mb``) and
    file size (1 MB); an audit hook refuses sockets, subprocesses, ``os.system``/``exec``/
    ``fork`` and ``ctypes``. A Markdown code fence (three backticks) around the code is removed.
    Linux and macOS.
    """
    code = _strip_fence(str(code))
    with tempfile.TemporaryDirectory(prefix="rlhf_tool_") as workdir:
        try:
            proc = subprocess.run(
                [sys.executable, "-I", "-c", _SANDBOX, str(max(1, math.ceil(timeout))),
                 str(memory_mb * 2**20), str(2**20)],
                input=code, capture_output=True, text=True, cwd=workdir, timeout=timeout + 1.0,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, start_new_session=True,
            )
        except subprocess.TimeoutExpired:
            return ToolResult(f"Error: the code ran longer than {timeout:g} s and was stopped.", ok=False)
    out = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        reason = {-9: "was killed (CPU time or memory limit)", -24: "ran out of CPU time"}.get(
            proc.returncode, f"exited with status {proc.returncode}")
        return ToolResult(f"Error: the code {reason}.\n{out}".strip(), ok=False)
    return ToolResult(out or "(no output)")


def _strip_fence(code: str) -> str:
    text = code.strip()
    if text.startswith("```"):
        text = text.split("\n", 1)[1] if "\n" in text else ""
        text = text.rsplit("```", 1)[0]
    return text


BUILTIN_TOOLS: dict[str, Callable] = {"calculator": calculator, "python": python}


def load_tools(names: Sequence[str]) -> dict[str, Callable]:
    """The tools ``env.tools`` names: a built-in (:data:`BUILTIN_TOOLS`) or a dotted path to a
    function (``my_pkg.tools.lookup``, called by its last component: ``lookup``)."""
    from .rewards import load_callable

    tools: dict[str, Callable] = {}
    for name in names:
        name = str(name)
        if name not in BUILTIN_TOOLS and "." not in name and ":" not in name:
            raise ConfigError(
                f"Unknown tool {name!r} in env.tools: the built-in tools are "
                f"{', '.join(BUILTIN_TOOLS)}; name a function of your own by its dotted path "
                "(my_pkg.tools.lookup).")
        fn = BUILTIN_TOOLS.get(name) or load_callable(name, what="Tool")
        key = name if name in BUILTIN_TOOLS else name.replace(":", ".").rsplit(".", 1)[-1]
        if key in tools:
            raise ConfigError(f"Two tools are called {key!r} (env.tools={list(names)}): rename one.")
        tools[key] = fn
    return tools


def describe_tools(tools: Mapping[str, Callable]) -> str:
    """A system-prompt paragraph naming each tool, its arguments and the call format."""
    lines = ["You can call tools. Write a call as <tool name=\"NAME\">ARGUMENTS</tool> and wait for "
             "its result; answer without a call when you are done. Tools:"]
    for name, fn in tools.items():
        params = ", ".join(inspect.signature(fn).parameters)
        doc = (inspect.getdoc(fn) or "").split("\n")[0]
        lines.append(f"- {name}({params}): {doc}")
    return "\n".join(lines)


# a call that never returns keeps its thread: 16 of them leave room for the rest to run
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="tool")


def run_tool(tools: Mapping[str, Callable], call: ToolCall, *, timeout: float = 10.0) -> ToolResult:
    """Call ``call.name`` with ``call.arguments``; whatever happens, a :class:`ToolResult`.

    A dict of arguments is passed as keywords, anything else as the single positional argument.
    A call that has not returned after ``timeout`` seconds is abandoned (its thread is left to
    finish; the ``python`` tool stops its own process) and reported as timed out.
    """
    fn = tools.get(call.name)
    if fn is None:
        return ToolResult(f"Error: there is no tool {call.name!r} (tools: {', '.join(tools)}).", ok=False)
    args, kwargs = ((), call.arguments) if isinstance(call.arguments, dict) else ((call.arguments,), {})
    future = _POOL.submit(fn, *args, **kwargs)
    try:
        out = future.result(timeout=timeout)
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
