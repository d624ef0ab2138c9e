"""Tools for agents: schemas from typed functions, tool calls parsed in the chat template's
format, and every way a call can go wrong ending in an error observation, never a crash."""

import os
import random
import time
from typing import Literal

import pytest

from rollwise.agents import Tool, Toolbox, ToolCall, ToolLimits, detect, parse_tool_calls
from rollwise.agents.builtin_tools import calculator


def lookup(city: str, unit: Literal["c", "f"] = "c", days: int = 1) -> str:
    """Weather for a city.

    Args:
        city: The city's name.
        unit: Degrees Celsius or Fahrenheit.
        days: How many days ahead.
    """
    return f"{city}:{unit}:{days}"


def test_schema_comes_from_the_signature_and_docstring():
    f = Tool.from_function(lookup).schema["function"]
    assert f["name"] == "lookup" and f["description"] == "Weather for a city."
    props = f["parameters"]["properties"]
    assert props["city"] == {"type": "string", "description": "The city's name."}
    assert props["unit"]["enum"] == ["c", "f"] and props["days"]["type"] == "integer"
    assert f["parameters"]["required"] == ["city"]


def test_a_function_without_a_documented_signature_is_a_clear_error():
    def bare(x):
        return x
    with pytest.raises(ValueError, match="type hints and a docstring"):
        Tool.from_function(bare)
    with pytest.raises(ValueError, match="two tools are named"):
        Toolbox([lookup, lookup])


def test_hermes_calls_are_parsed_one_per_block_with_errors_kept():
    text = ('think <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> then '
            '<tool_call>\n{"name": "b", "arguments": "{\\"y\\": 2}"}\n</tool_call>'
            '<tool_call>{"name": }</tool_call><tool_call>{"arguments": {}}</tool_call>'
            '<tool_call>{"name": "c"')
    calls = parse_tool_calls(text, "hermes")
    assert [(c.name, c.arguments) for c in calls[:2]] == [("a", {"x": 1}), ("b", {"y": 2})]
    assert calls[2].error.startswith("not JSON") and calls[3].error == "the call has no 'name'"
    assert "not closed" in calls[4].error and len(calls) == 5
    assert parse_tool_calls("no calls here", "hermes") == []


def test_llama_json_calls_and_format_detection():
    call, = parse_tool_calls('{"name": "lookup", "parameters": {"city": "Oslo"}}', "json")
    assert (call.name, call.arguments) == ("lookup", {"city": "Oslo"})
    assert parse_tool_calls("The answer is 4.", "json") == []
    assert detect("{% for t in tools %}<tool_call>{{ t }}</tool_call>{% endfor %}") == "hermes"
    assert detect('{"name": function name, "parameters": dictionary of argument}') == "json"
    assert detect(None) == "hermes"
    with pytest.raises(ValueError, match="unknown tool-call format"):
        parse_tool_calls("", "xml")


def _raises(msg: str) -> str:
    """Fail on purpose.

    Args:
        msg: The message.
    """
    raise RuntimeError(msg)


def _hangs(seconds: int) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


def _garbage(kind: str) -> str:
    """Return something that is not text.

    Args:
        kind: What to return.
    """
    if kind == "object":
        return object()
    if kind == "dict":
        return {"a": [1, 2]}
    if kind == "long":
        return "x" * 10_000
    if kind == "exit":
        os._exit(3)
    return lambda: 0  # cannot be sent back


@pytest.fixture(scope="module")
def box():
    return Toolbox([lookup, _raises, _hangs, _garbage, calculator],
                   ToolLimits(timeout_s=0.5, max_chars=100))


def test_each_failure_is_an_error_observation(box):
    def call(name, **args):
        return box.call(ToolCall(name, args))
    assert call("lookup", city="Oslo", days=3) == ("Oslo:c:3", True)
    assert box.call(ToolCall(None, error="not JSON"))[0] == "error: malformed tool call: not JSON"
    obs, ok = call("missing")
    assert not ok and obs.startswith("error: unknown tool 'missing'") and "lookup" in obs
    assert "missing ['city']" in call("lookup")[0]
    assert "unknown ['town']" in call("lookup", city="x", town="y")[0]
    assert "'days' must be integer" in call("lookup", city="x", days="3")[0]
    assert "'days' must be integer" in call("lookup", city="x", days=True)[0]
    assert "must be one of ['c', 'f']" in call("lookup", city="x", unit="k")[0]
    assert box.call(ToolCall("lookup", [1]))[0].endswith("must be a JSON object, got list")
    assert call("_raises", msg="boom") == ("error: _raises raised RuntimeError: boom", False)


def test_a_hanging_tool_ends_within_its_limit(box):
    t0 = time.monotonic()
    obs, ok = box.call(ToolCall("_hangs", {"seconds": 60}))
    assert not ok and obs == "error: _hangs did not answer within 0.5 s"
    assert time.monotonic() - t0 < 10  # the limit, not the tool's 60 s


def test_garbage_results_become_text_or_errors(box):
    def call(kind):
        return box.call(ToolCall("_garbage", {"kind": kind}))
    assert call("dict") == ('{"a": [1, 2]}', True)
    assert call("object")[0].startswith("<object object at")
    obs, ok = call("long")
    assert ok and obs == "x" * 100 + "... [cut at 100 characters]"
    obs, ok = call("exit")
    assert not ok and obs.startswith("error: _garbage died")
    obs, ok = call("lambda")
    assert not ok and obs.startswith("error: _garbage")


def _expression(rng: random.Random, depth: int = 0) -> str:
    if depth > 2 or rng.random() < 0.3:
        return str(rng.randint(-50, 50))
    op = rng.choice(["+", "-", "*", "//", "%"])
    return f"({_expression(rng, depth + 1)} {op} {_expression(rng, depth + 1)})"


def test_calculator_agrees_with_python_on_random_expressions():
    rng = random.Random(0)
    checked = 0
    for _ in range(300):
        e = _expression(rng)
        try:
            want = eval(e)  # the reference: Python itself on a string this test built
        except ZeroDivisionError:
            with pytest.raises(ZeroDivisionError):
                calculator(e)
            continue
        assert calculator(e) == str(want), e
        checked += 1
    assert checked > 200
    assert calculator("7 / 2") == "3.5" and calculator("2 ** 10") == "1024"


@pytest.mark.parametrize("bad, why", [
    ("9 ** 9 ** 9", "exponent"), ("10 ** 60 * 10 ** 60", "digits"),
    ("__import__('os').system('id')", "not Call"), ("x + 1", "not Name"),
    ("(1).real", "not Attribute"), ("1 +", "not an arithmetic expression"),
    ("1" * 300, "longer than"),
])
def test_calculator_refuses_what_is_not_small_arithmetic(bad, why):
    with pytest.raises(ValueError, match=why):
        calculator(bad)


def test_the_python_tool_runs_in_the_sandbox():
    box = Toolbox.from_names(["python"], ToolLimits(timeout_s=30))
    assert box.call(ToolCall("python", {"code": "print(6 * 7)"})) == ("42\n", True)
    # the program's failure is the tool's result (the call itself worked), status first
    obs, ok = box.call(ToolCall("python", {"code": "while True: pass"}))
    assert ok and obs.startswith(("[timeout:", "[cpu_time:"))
    obs, _ = box.call(ToolCall("python", {"code": "print(open('/etc/passwd').read())"}))
    assert obs.startswith("[blocked:") and "root:" not in obs
    obs, _ = box.call(ToolCall("python", {"code": "import socket\n"
                                          "socket.create_connection(('1.1.1.1', 80), 2)"}))
    assert obs.startswith(("[blocked:", "[error:"))


def test_plain_calls_give_their_argument_to_the_first_parameter():
    from rollwise.agents.toolcalls import parse_plain
    calls = parse_plain("first calculator(2**10) then nope(1)")
    assert [(c.name, c.positional) for c in calls] == [("calculator", "2**10"), ("nope", "1")]
    box = Toolbox([calculator])
    assert box.call(calls[0]) == ("1024", True)
    text, ok = box.call(calls[1])
    assert not ok and "unknown tool 'nope'" in text


def _pid(tag: str) -> str:
    """The process the tool runs in.

    Args:
        tag: Raise when it is 'boom'.
    """
    if tag == "boom":
        raise ValueError("bounded boom")
    return str(os.getpid())


def test_a_bounded_tool_runs_in_this_process_and_still_fails_softly():
    """`bounded` tools (the calculator) skip the child process; their errors are still
    observations."""
    import functools
    bounded = functools.wraps(_pid)(lambda tag: _pid(tag))
    bounded.bounded = True
    forked, inproc = Toolbox([_pid]), Toolbox([bounded])
    assert forked.call(ToolCall("_pid", {"tag": "x"}))[0] != str(os.getpid())
    assert inproc.call(ToolCall("_pid", {"tag": "x"})) == (str(os.getpid()), True)
    assert inproc.call(ToolCall("_pid", {"tag": "boom"})) == \
        ("error: _pid raised ValueError: bounded boom", False)
    assert calculator.bounded and Toolbox([calculator]).call(
        ToolCall("calculator", {"expression": "9**99"}))[0].startswith("error: calculator raised")
