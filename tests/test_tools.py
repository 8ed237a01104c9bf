"""Tools for multi-turn episodes: parsing calls, the built-ins, user functions, failures as text."""

import shutil
import time

import pytest

from rlhf_torchrl.envs.sandbox import SandboxSpec
from rlhf_torchrl.envs.tools import (
    PythonTool,
    ToolCall,
    ToolResult,
    calculator,
    describe_tools,
    load_tools,
    parse_tool_calls,
    run_tool,
)
from rlhf_torchrl.errors import ConfigError


def lookup(key: str) -> dict:
    """Look a key up in a tiny table."""
    return {"capital of France": "Paris"}[key]


def slow(seconds: float = 5.0) -> str:
    time.sleep(float(seconds))
    return "done"


def ends_the_episode(answer: str) -> ToolResult:
    return ToolResult(f"submitted {answer}", reward=1.0 if answer == "42" else 0.0, stop=True)


def test_calls_are_parsed_in_order_with_json_or_raw_arguments():
    text = ('Let me add. <tool name="calculator">66 + 46</tool> and then '
            '<tool name="lookup">{"key": "capital of France"}</tool> done')
    assert parse_tool_calls(text) == [ToolCall("calculator", "66 + 46"),
                                      ToolCall("lookup", {"key": "capital of France"})]
    assert parse_tool_calls("no call here") == []


@pytest.mark.parametrize("body, argument", [("42", "42"), ('"12 + 30"', "12 + 30"),
                                            ("[1, 2]", "[1, 2]"), ("2.5", "2.5")])
def test_a_body_that_is_json_but_no_object_is_the_single_argument(body, argument):
    """A JSON number, string or list is one argument (its text), never keyword arguments: a
    policy that writes <tool name="calculator">42</tool> gets "42" back, not a crash."""
    (call,) = parse_tool_calls(f'<tool name="calculator">{body}</tool>')
    assert call == ToolCall("calculator", argument)
    if body != "[1, 2]":
        assert run_tool({"calculator": calculator}, call).ok


@pytest.mark.parametrize("expression, value", [("66 + 46", "112"), ("7 / 2", "3.5"),
                                               ("-(3 - 10) * 2 ** 3", "56"), ("17 // 5 % 2", "1"),
                                               ("1/3", "0.333333333333"), ("12 - 5 =", "7")])
def test_calculator_evaluates_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression", ["__import__('os').system('ls')", "2 ** 1000", "x + 1",
                                        "1 / 0", "9" * 300, "[1, 2]"])
def test_calculator_runs_nothing_but_arithmetic(expression):
    result = run_tool({"calculator": calculator}, ToolCall("calculator", expression))
    assert not result.ok and result.content.startswith("Error: calculator failed")


@pytest.fixture(scope="module")
def python():
    """The python tool with a 5-second limit (its sandbox: tests/test_sandbox.py)."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    return PythonTool(SandboxSpec(timeout=5.0, memory_mb=256))


def test_python_tool_runs_code_and_reports_its_output(python):
    assert python("print(sum(range(10)))").content == "45"
    assert python("```python\nprint('fenced')\n```").content == "fenced"
    failed = python("raise ValueError('no')")
    assert not failed.ok and "ValueError: no" in failed.content


@pytest.mark.parametrize("code, says", [
    # refused at the socket (seccomp: AF_UNIX alone), or where no filter loads, by the empty
    # network namespace
    ("import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)",
     ("Address family not supported", "Network is unreachable")),
    ("open('/usr/lib/planted', 'w')", "Read-only file system"),
    ("x = bytearray(2 * 1024 ** 3)", "MemoryError"),
    ("f = open('big', 'w')\nfor _ in range(100):\n    f.write('x' * 2 ** 20)", "File too large"),
])
def test_python_tool_is_sandboxed(python, code, says):
    result = python(code)
    says = (says,) if isinstance(says, str) else says
    assert not result.ok and any(s in result.content for s in says), result.content


def test_python_tool_stops_code_that_runs_too_long(python):
    """Stopped by the tool itself (its message, not run_tool's "did not answer")."""
    result = run_tool({"python": python}, ToolCall("python", "while True: pass"), timeout=1.0)
    assert not result.ok, result.content
    assert "CPU time" in result.content or "ran longer than 1 s" in result.content, result.content


def test_user_tools_by_dotted_path_and_their_failures_become_messages():
    tools = load_tools(["calculator", "test_tools.lookup", "test_tools.slow", "test_tools.ends_the_episode"])
    assert list(tools) == ["calculator", "lookup", "slow", "ends_the_episode"]
    assert run_tool(tools, ToolCall("lookup", {"key": "capital of France"})).content == "Paris"
    missing_key = run_tool(tools, ToolCall("lookup", {"key": "nowhere"}))
    assert not missing_key.ok and "KeyError" in missing_key.content
    bad_args = run_tool(tools, ToolCall("lookup", {"country": "France"}))
    assert not bad_args.ok and "TypeError" in bad_args.content
    unknown = run_tool(tools, ToolCall("search", "x"))
    assert not unknown.ok and "no tool 'search'" in unknown.content
    timed_out = run_tool(tools, ToolCall("slow", {"seconds": 3}), timeout=0.2)
    assert not timed_out.ok and "did not answer within 0.2 s" in timed_out.content
    final = run_tool(tools, ToolCall("ends_the_episode", "42"))
    assert final.stop and final.reward == 1.0 and final.content == "submitted 42"
    assert "lookup(key): Look a key up" in describe_tools(tools)


def test_bad_tool_names_get_one_clear_line():
    with pytest.raises(ConfigError, match="Unknown tool 'calculatr' in env.tools: the built-in tools are calculator, python"):
        load_tools(["calculatr"])
    with pytest.raises(ConfigError, match="Two tools are called 'lookup'"):
        load_tools(["test_tools.lookup", "test_tools:lookup"])
