"""The built-in tool environment (align.envs.tools) and the sandboxed python tool (align.envs.sandbox).

Schemas are compared with transformers' own ``get_json_schema`` on the same functions; tool calls are parsed from
outputs in the formats the models emit and from assistant messages rendered by the real Qwen2.5 chat template;
the sandbox runs real subprocesses with small limits.
"""

from __future__ import annotations

import os
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Literal, Optional

import pytest

from align.data import ChatTemplate, InputError
from align.envs import Step, check_step
from align.envs.sandbox import PythonLimits, python, run_python
from align.envs.tools import load_tools, make_tool_env, parse_tool_calls, tool_schema
from tests.helpers_tokenizer import chat_template

FAST = PythonLimits(timeout_s=3, cpu_s=3, memory_mb=256, file_mb=1, max_procs=8, max_output_chars=500)
GONE_WAIT_S = 5.0  # the longest a killed process may take to disappear

# ------------------------------------------------------------------------------------------------ schemas


def get_current_temperature(location: str, unit: Literal["celsius", "fahrenheit"] = "celsius") -> float:
    """Get the current temperature at a location.

    Args:
        location: The location to get the temperature for, in the format "City, Country".
        unit: The unit to return the temperature in.

    Returns:
        The current temperature at the specified location in the specified unit, as a float.
    """
    return 22.0


def search(query: str, limit: int, tags: list[str] | None = None, exact: bool = False, boost: Optional[float] = None):  # noqa: UP045
    """Search the index
    for documents.

    A second paragraph the model does not need.

    Args:
        query: What to look for; a long description that
            goes on over a second line.
        limit: How many results to return at most.
        tags: Only documents with one of these tags.
        exact: Match the query exactly.
        boost: A score multiplier.
    """


def configure(options: dict[str, int], mode: str, weights: dict, anything: Any, pair: tuple[int, str]) -> str:
    """Set options.

    Args:
        options: Named integer options.
        mode: The mode to run in (choices: ["fast", "slow"])
        weights: Free-form weights.
        anything: Any JSON value.
        pair: A number and a label.
    """
    return mode


def mixed(x: int | str, level: Literal[1, 2, 3], nested: list[list[int]]) -> None:
    """Mix types.

    Args:
        x: A number or a word.
        level: The level.
        nested: A matrix.
    """


class Box:
    def area(self, width: float, height: float) -> float:
        """The area of a box.

        Args:
            width: Its width.
            height: Its height.
        """
        return width * height


@pytest.mark.parametrize("fn", [get_current_temperature, search, configure, mixed, Box().area, python])
def test_schema_matches_transformers(fn: Any) -> None:
    from transformers.utils.chat_template_utils import get_json_schema

    assert tool_schema(fn) == get_json_schema(fn)


def test_schema_comparison_negative_control() -> None:
    """The comparison sees a one-hint change: the schema of a function with one type changed differs."""
    from transformers.utils.chat_template_utils import get_json_schema

    def changed(location: str, unit: Literal["celsius", "kelvin"] = "celsius") -> float:
        return 0.0

    changed.__name__, changed.__doc__ = "get_current_temperature", get_current_temperature.__doc__
    assert tool_schema(get_current_temperature) != get_json_schema(changed)
    assert tool_schema(changed) == get_json_schema(changed)


def test_schema_shape() -> None:
    s = tool_schema(search)
    assert s["type"] == "function" and s["function"]["name"] == "search"
    assert (
        s["function"]["description"]
        == "Search the index\nfor documents.\n\nA second paragraph the model does not need."
    )
    p = s["function"]["parameters"]
    assert p["required"] == ["query", "limit"]
    assert (
        p["properties"]["query"]["description"]
        == "What to look for; a long description that goes on over a second line."
    )
    assert p["properties"]["tags"] == {"type": "array", "items": {"type": "string"}, "nullable": True,
                                       "description": "Only documents with one of these tags."}  # fmt: skip
    assert tool_schema(configure)["function"]["parameters"]["properties"]["mode"]["enum"] == ["fast", "slow"]


class Custom:
    pass


def no_hint(x):
    """Do.

    Args:
        x: A thing.
    """


def var_args(*values: int) -> int:
    """Sum.

    Args:
        values: The numbers.
    """
    return sum(values)


def var_kwargs(**options: int) -> int:
    """Count.

    Args:
        options: The options.
    """
    return len(options)


def custom_type(x: Custom) -> None:
    """Do.

    Args:
        x: A thing.
    """


def no_doc(x: int) -> int:
    return x


def undocumented_param(x: int, y: int) -> int:
    """Add.

    Args:
        x: The first.
    """
    return x + y


def only_args(x: int) -> int:
    """Args:
    x: The number.
    """
    return x


@pytest.mark.parametrize(
    ("fn", "why"),
    [
        (no_hint, "parameter 'x' has no type hint"),
        (var_args, "*values"),
        (var_kwargs, "**options"),
        (custom_type, "has no JSON schema"),
        (no_doc, "no docstring"),
        (undocumented_param, "does not describe 'y'"),
        (only_args, "no description"),
    ],
)
def test_schema_refuses_what_it_cannot_describe(fn: Any, why: str) -> None:
    with pytest.raises(InputError) as e:
        tool_schema(fn)
    assert "--tools" in str(e.value) and f"{fn.__name__}()" in str(e.value) and why in str(e.value)


# ------------------------------------------------------------------------------------------------ loading


def test_load_tools_from_specs_and_callables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "mytools.py"
    f.write_text(
        textwrap.dedent('''
        def add(a: int, b: int) -> int:
            """Add two numbers.

            Args:
                a: The first.
                b: The second.
            """
            return a + b
    ''')
    )
    (tmp_path / "modtools.py").write_text(f.read_text().replace("def add", "def plus"))
    monkeypatch.syspath_prepend(str(tmp_path))
    tools = load_tools([f"{f}:add", "modtools:plus", "python"], [get_current_temperature])
    assert [t.name for t in tools] == ["add", "plus", "python", "get_current_temperature"]
    assert tools[0].fn(2, 3) == 5 and tools[2].fn is python
    assert tools[0].schema == tool_schema(tools[0].fn) and tools[3].spec is None


def test_load_tools_bad_input_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"--tools 'nocolon': expected 'module:function'"):
        load_tools(["nocolon"])
    with pytest.raises(InputError, match=r"--tools .*no such file"):
        load_tools([f"{tmp_path}/missing.py:fn"])
    with pytest.raises(InputError, match=r"--tools 'no_such_mod_xyz:fn'.*--tools path/to/file.py:function"):
        load_tools(["no_such_mod_xyz:fn"])
    with pytest.raises(InputError, match=r"--reward 'nocolon'"):  # the rewards keep their own flag
        from align.rewards import load_rewards

        load_rewards(["nocolon"])
    with pytest.raises(InputError, match=r"two tools are named 'python'"):
        load_tools(["python"], [python])
    with pytest.raises(InputError, match=r"not a function"):
        load_tools(None, ["python"])


# ------------------------------------------------------------------------------------------------ parsing

QWEN_TWO_CALLS = """<tool_call>
{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}
</tool_call>
<tool_call>
{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", "date": "2024-10-01"}}
</tool_call>"""


def test_parse_hermes_qwen() -> None:
    assert parse_tool_calls(QWEN_TWO_CALLS) == [
        {"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}},
        {"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", "date": "2024-10-01"}},
    ]
    qwen3 = '<think>\nI need the weather.\n</think>\n\n<tool_call>\n{"name": "w", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert parse_tool_calls(qwen3) == [{"name": "w", "arguments": {"city": "Paris"}}]
    unclosed = 'Let me check.\n<tool_call>\n{"name": "w", "arguments": {}}\n'  # generation stopped at </tool_call>
    assert parse_tool_calls(unclosed) == [{"name": "w", "arguments": {}}]
    assert parse_tool_calls("The temperature is 22 degrees.") == []


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3"])
def test_parse_what_the_real_template_renders(name: str) -> None:
    """An assistant message with tool calls, rendered by the model's own template, parses back to those calls."""
    calls = [
        {"name": "add", "arguments": {"a": 2, "b": 40}},
        {"name": "python", "arguments": {"code": "print('hi')\n"}},
    ]
    msgs = [{"role": "user", "content": "Go."},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": c} for c in calls]}]  # fmt: skip
    text = ChatTemplate(chat_template(name)).render(msgs, add_generation_prompt=False)
    assistant = text.rsplit("<|im_start|>assistant", 1)[1].split("<|im_end|>")[0]
    assert "<tool_call>" in assistant and parse_tool_calls(assistant) == calls


def test_parse_llama31_json() -> None:
    plain = '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}'
    want = [{"name": "get_current_conditions", "arguments": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}]
    assert parse_tool_calls(plain) == want
    assert parse_tool_calls(f"<|python_tag|>{plain}<|eom_id|>") == want
    assert parse_tool_calls(f"  {plain}\n<|eot_id|>") == want
    assert parse_tool_calls('{"answer": 42}') == []  # a JSON answer is not a call
    assert parse_tool_calls('{"name": "f", "parameters": {"x": 1}} and then some text')[0]["error"].startswith(
        "the tool call is not valid JSON"
    )


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>', "not valid JSON"),
        ('<tool_call>\n{"arguments": {"x": 1}}\n</tool_call>', 'no "name"'),
        ('<tool_call>\n{"name": "f", "arguments": "x=1"}\n</tool_call>', '"arguments" must be a JSON object'),
        ('<tool_call>\n["f", {"x": 1}]\n</tool_call>', "must be a JSON object, got a list"),
        ('<|python_tag|>{"parameters": {"x": 1}}', 'no "name"'),
        ('<|python_tag|>{"name": "f", "parameters": [1]}', '"parameters" must be a JSON object'),
        ('<|python_tag|>{"name": "f", ', "not valid JSON"),
    ],
)
def test_parse_malformed(text: str, error: str) -> None:
    (call,) = parse_tool_calls(text)
    assert error in call["error"] and "arguments" not in call


def test_parse_keeps_good_calls_beside_a_bad_one() -> None:
    text = QWEN_TWO_CALLS.replace('"date": "2024-10-01"}}', '"date": }}')
    good, bad = parse_tool_calls(text)
    assert good["name"] == "get_current_temperature" and "error" in bad


# ------------------------------------------------------------------------------------------------ the environment

RELEASE = threading.Event()


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def fail(reason: str) -> str:
    """Always raises.

    Args:
        reason: Why.
    """
    raise ValueError(reason)


def hang(x: int) -> int:
    """Waits for the test to let it go.

    Args:
        x: Anything.
    """
    RELEASE.wait(30)
    return x


def quit_(code: int) -> None:
    """Raises SystemExit.

    Args:
        code: The status.
    """
    raise SystemExit(code)


def big(n: int) -> str:
    """A long string.

    Args:
        n: Its length.
    """
    return "y" * n


def call(name: str, **args: Any) -> str:
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


@pytest.fixture
def env_cls() -> type:
    return make_tool_env(load_tools(["python"], [add, fail, hang, quit_, big]), timeout_s=0.5, max_output_chars=50)


def test_env_runs_calls_in_order(env_cls: type) -> None:
    assert env_cls.tools == [tool_schema(f) for f in (python, add, fail, hang, quit_, big)]  # on the class
    env = env_cls(prompt="What is 2+40?", answer="42")
    assert env.reset() == [{"role": "user", "content": "What is 2+40?"}]
    assert [s["function"]["name"] for s in env.tools] == ["python", "add", "fail", "hang", "quit_", "big"]
    out = check_step(env.step("Sure.\n" + call("add", a=2, b=40) + "\n" + call("python", code="print(6 * 7)")))
    assert out == Step([{"role": "tool", "name": "add", "content": "42"},
                        {"role": "tool", "name": "python", "content": "42\n"}], None, False,
                       {"tool_calls": 2, "tool_errors": 0})  # fmt: skip
    assert check_step(env.step("The answer is 42.")) == Step(None, None, True, {"tool_calls": 0, "tool_errors": 0})


def test_env_tool_messages_render_through_the_template(env_cls: type) -> None:
    msgs = env_cls(prompt="Go.").reset()
    completion = call("add", a=1, b=2)
    msgs.append({"role": "assistant", "content": completion})
    msgs += env_cls().step(completion).observation
    text = ChatTemplate(chat_template("qwen2.5")).render(msgs)
    assert text.endswith("<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_env_errors_are_observations(env_cls: type) -> None:
    env = env_cls(messages=[{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Hi"}])
    assert env.reset()[0]["role"] == "system"
    completion = "".join([
        call("nope", x=1),
        "<tool_call>{bad json</tool_call>",
        call("add", a=1),
        call("fail", reason="disk on fire"),
        call("quit_", code=3),
        call("python", code=5),
        call("big", n=1000),
    ])  # fmt: skip
    out = check_step(env.step(completion))
    contents = [m["content"] for m in out.observation]
    assert "no tool named 'nope'" in contents[0] and "'add'" in contents[0]
    assert "not valid JSON" in contents[1] and "name" not in out.observation[1]
    assert "wrong arguments for add" in contents[2] and "'b'" in contents[2]
    assert "fail raised ValueError: disk on fire" in contents[3]
    assert "SystemExit: 3" in contents[4]
    assert '"code" must be a string' in contents[5]
    assert contents[6].startswith("y" * 50 + "\n[output cut: the first 50 of 1000 characters]")
    assert out.info == {"tool_calls": 7, "tool_errors": 6} and out.done is False


def power(base: int, exp: int) -> int:
    """A power, which may be too long to print.

    Args:
        base: The base.
        exp: The exponent.
    """
    return base**exp


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ("[" * 100_000, "nests too deeply to read"),  # RecursionError in json.loads
        ('{"name": "add", "arguments": ' + '{"a": ' * 100_000, "nests too deeply to read"),
        ('{"name": "add", "arguments": {"a": ' + "[" * 200 + "]" * 200 + "}}", "nests more than 64 levels deep"),
        ('{"name": "add", "arguments": {"a": ' + "9" * 5000 + ', "b": 1}}', "Exceeds the limit"),  # ValueError
        ('{"name": "python", "arguments": {"code": "print(1) # \\ud800"}}', "a lone surrogate"),  # UnicodeEncodeError
        ('{"name": "add\\udfff", "arguments": {}}', "a lone surrogate"),
    ],
)
@pytest.mark.parametrize("wrap", ["<tool_call>{}</tool_call>", "<|python_tag|>{}"])
def test_an_unreadable_call_is_a_tool_error_not_an_exception(env_cls: type, body: str, error: str, wrap: str) -> None:
    """Issue 42: RecursionError / ValueError / UnicodeEncodeError escaped step() and ended the run."""
    out = check_step(env_cls(prompt="x").step(wrap.replace("{}", body)))
    assert out.info == {"tool_calls": 1, "tool_errors": 1} and out.done is False, out
    (msg,) = out.observation
    assert msg["content"].startswith("Error: ") and error in msg["content"] and "name" not in msg, msg
    msg["content"].encode("utf-8")  # the message itself is text
    # control: the same call, readable, runs
    good = check_step(env_cls(prompt="x").step(wrap.replace("{}", '{"name": "add", "arguments": {"a": 1, "b": 2}}')))
    assert good.observation[0]["content"] == "3" and good.info["tool_errors"] == 0


def test_a_result_that_cannot_be_printed_is_a_message() -> None:
    env = make_tool_env(load_tools(None, [power]), timeout_s=5)(prompt="x")
    out = check_step(env.step(call("power", base=10, exp=5000)))  # str() of it: ValueError (int digit limit)
    assert "int that cannot be shown as text: ValueError" in out.observation[0]["content"], out
    assert check_step(env.step(call("power", base=10, exp=3))).observation[0]["content"] == "1000"  # control


def test_repeated_tools_flags_accumulate_and_a_duplicate_name_is_refused(tmp_path, monkeypatch, capsys) -> None:
    """Issue 42: --tools python --tools my.py:python kept only the last: the sandboxed tool swapped silently."""
    from align.train import main

    mine = tmp_path / "my_tools.py"
    mine.write_text(
        textwrap.dedent('''
        def python(code: str) -> str:
            """Runs code without a sandbox.

            Args:
                code: The code.
            """
            return str(eval(code))
    ''')
    )
    spec = f"{mine}:python"
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "1+1="}\n')
    base = ["--out", str(tmp_path / "run"), "--model", str(tmp_path / "no_model"), "--train-data", str(data)]
    assert main([*base, "--tools", "python", "--tools", spec]) == 2
    err = capsys.readouterr().err
    assert f"two tools are named 'python' (python and {spec})" in err, err
    # control: distinct names pass the tool check (and stop later, at the missing model)
    (tmp_path / "other.py").write_text(mine.read_text().replace("def python", "def calc"))
    assert main([*base, "--tools", "python", "--tools", f"{tmp_path / 'other.py'}:calc"]) == 2
    err = capsys.readouterr().err
    assert "two tools" not in err and "no_model" in err, err


def test_env_abandons_a_hung_tool(env_cls: type) -> None:
    t0 = time.monotonic()
    out = env_cls(prompt="x").step(call("hang", x=1))
    try:
        assert time.monotonic() - t0 < 5
        assert "ran past the 0.5 s tool timeout and was abandoned" in out.observation[0]["content"]
        assert out.info == {"tool_calls": 1, "tool_errors": 1}
        assert any(t.name == "tool-hang" for t in threading.enumerate())  # abandoned, still alive
    finally:
        RELEASE.set()


def test_env_python_timeout_is_a_tool_error() -> None:
    env = make_tool_env(load_tools(["python"]), timeout_s=0.5)(prompt="x")
    out = env.step(call("python", code="while True: pass"))
    assert "timed out after 0.5 s" in out.observation[0]["content"] and out.info["tool_errors"] == 1


def test_env_bad_rows_and_configs() -> None:
    from align.envs import EnvError

    env_cls = make_tool_env(load_tools(["python"]))
    with pytest.raises(EnvError, match=r"'messages' list or a 'prompt' string; the row has \['question'\]"):
        env_cls(question="q").reset()
    with pytest.raises(InputError, match="at least one tool"):
        make_tool_env([])


# ------------------------------------------------------------------------------------------------ the python tool


def test_python_output_and_traceback() -> None:
    assert run_python("print('hello'); import sys; print('warn', file=sys.stderr)", FAST) == ("hello\nwarn\n", False)
    out, timed_out = run_python("def f():\n    return 1 / 0\nf()", FAST)
    assert "Traceback (most recent call last)" in out and "ZeroDivisionError: division by zero" in out
    assert out.endswith("[exit status 1]") and not timed_out


def test_python_infinite_loop_hits_the_wall_timeout() -> None:
    t0 = time.monotonic()
    out, timed_out = run_python("print('start', flush=True)\nwhile True: pass", PythonLimits(timeout_s=0.5))
    assert timed_out and out.startswith("start\n") and "timed out after 0.5 s" in out
    assert time.monotonic() - t0 < 5


def test_python_cpu_limit() -> None:
    out, timed_out = run_python("while True: pass", PythonLimits(timeout_s=10, cpu_s=1))
    assert not timed_out and "[killed by SIGXCPU (the 1 s CPU limit)]" in out


def test_python_memory_bomb_is_stopped() -> None:
    out, _ = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))", FAST)
    assert "MemoryError" in out
    # negative control: the same allocation, bounded to 100 MB, fits under a 1 GiB limit
    ok, _ = run_python("chunks = [bytearray(10**7) for _ in range(10)]\nprint('fits')", PythonLimits(memory_mb=1024))
    assert ok == "fits\n"


def _gone(pid: int) -> bool:
    """The process no longer exists, or is a zombie (dead, waiting to be reaped by whoever adopted it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _wait_gone(pids: list[int]) -> list[int]:
    deadline = time.monotonic() + GONE_WAIT_S
    while (alive := [p for p in pids if not _gone(p)]) and time.monotonic() < deadline:
        time.sleep(0.02)
    return alive


FORK_BOMB = """
import os, time
pids = []
try:
    for _ in range(200):  # bounded, so a broken limit fails this test instead of the machine
        pid = os.fork()
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        pids.append(pid)
except OSError as e:
    print("fork failed after", len(pids), type(e).__name__)
print("pids", *pids)
"""


def test_python_fork_bomb_is_stopped_and_its_children_killed() -> None:
    out, timed_out = run_python(FORK_BOMB, FAST)
    assert "fork failed after" in out and "BlockingIOError" in out and not timed_out, out
    n = int(out.split("fork failed after ")[1].split()[0])
    assert n <= FAST.max_procs
    pids = [int(p) for p in out.split("pids")[1].split()]
    assert len(pids) == n and _wait_gone(pids) == []


def test_python_kills_what_it_spawned_on_timeout() -> None:
    code = "import subprocess\np = subprocess.Popen(['sleep', '60'])\nprint(p.pid, flush=True)\nwhile True: pass"
    out, timed_out = run_python(code, PythonLimits(timeout_s=1))
    child = int(out.split()[0])
    assert timed_out and _wait_gone([child]) == []


def test_python_big_output_is_cut() -> None:
    out, _ = run_python("print('x' * 100_000)", FAST)
    assert out == "x" * 500 + "\n[output cut: the first 500 characters of 100001 bytes]"
    short, _ = run_python("print('x' * 499)", FAST)  # negative control: under the limit, no marker
    assert short == "x" * 499 + "\n"


def test_python_file_size_limit() -> None:
    out, _ = run_python("open('f', 'wb').write(b'z' * (2 << 20))", FAST)
    assert "File too large" in out


def test_python_writes_land_in_a_removed_temp_cwd() -> None:
    code = "import os\nopen('note.txt', 'w').write('hi')\nprint(os.getcwd())\nprint(os.environ['HOME'])"
    out, _ = run_python(code, FAST)
    cwd, home = out.split()
    assert cwd == home and Path(cwd).name.startswith("align_python_") and cwd != os.getcwd()
    assert not Path(cwd).exists()
    assert not Path("note.txt").exists()


def test_python_parent_env_is_not_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALIGN_TEST_SECRET", "hunter2-secret")
    monkeypatch.setenv("PYTHONPATH", "/nowhere")
    out, _ = run_python("import os, sys\nprint(sorted(os.environ))\nprint(os.environ)\nprint(sys.path)", FAST)
    assert "hunter2-secret" not in out and "/nowhere" not in out
    keys = eval(out.splitlines()[0])  # a list literal printed by the test's own code
    assert set(keys) <= {"PATH", "LANG", "HOME", "LC_CTYPE"} and {"PATH", "HOME"} <= set(keys)
    assert os.environ["ALIGN_TEST_SECRET"] == "hunter2-secret"  # negative control: the parent has it


def test_python_limits_validated() -> None:
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        PythonLimits(timeout_s=0)
