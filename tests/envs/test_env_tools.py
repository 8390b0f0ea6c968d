"""Tool-call parsers (round trips, malformed calls), tools from functions (argument
binding), and the calc tool with the digits-as-words numbers."""
import pytest

from rlctl.envs.calc import calc, read_number
from rlctl.tasks.arithmetic import spaced
from rlctl.envs.tools import (PARSERS, JsonParser, TagParser, ToolArgumentError, ToolCall,
                              ToolCallError, make_parser, make_tool)


def test_tag_round_trip_and_text_around_the_call():
    p = TagParser()
    call = ToolCall("calc", ("1", "2", "3", "*", "4", "5"))
    assert p.format(call) == "<call> calc 1 2 3 * 4 5 </call>"
    assert p.parse("<call> calc 1 2 3 * 4 5 </call>") == call
    assert p.parse("let me see <call> calc 1 + 2 </call> <call> other </call>") == \
        ToolCall("calc", ("1", "+", "2"))
    assert p.parse("5 5 3 5") is None and p.parse("") is None
    assert p.stop == ("</call>",)


@pytest.mark.parametrize("text, why", [("<call> calc 1 2", "without </call>"),
                                       ("<call> </call>", "names no tool"),
                                       ("<call> calc <call> x </call>", "inside a call")])
def test_tag_malformed(text, why):
    with pytest.raises(ToolCallError, match=why):
        TagParser().parse(text)


def test_json_round_trip():
    p = JsonParser()
    call = ToolCall("calc", {"expression": "123*45"})
    text = '<tool_call>{"name": "calc", "arguments": {"expression": "123*45"}}</tool_call>'
    assert p.format(call) == text and p.parse(text) == call
    assert p.parse('ok <tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>') == \
        ToolCall("f", {"x": 1})
    assert p.parse('<tool_call>{"name": "f"}</tool_call>') == ToolCall("f", {})
    assert p.parse("no call here") is None


@pytest.mark.parametrize("inner, why", [('{"name": "f", ', "not valid JSON"),
                                        ('{"arguments": {}}', '"name" string'),
                                        ('["f"]', '"name" string'),
                                        ('{"name": "f", "arguments": [1]}', "JSON object")])
def test_json_malformed(inner, why):
    with pytest.raises(ToolCallError, match=why) as exc:
        JsonParser().parse(f"<tool_call>{inner}</tool_call>")
    assert "\n" not in str(exc.value)
    with pytest.raises(ToolCallError, match="without"):
        JsonParser().parse('<tool_call>{"name": "f"}')


def test_parser_registry_and_a_user_parser(tmp_path):
    assert PARSERS.names() == ["json", "tag"]
    with pytest.raises(ValueError) as exc:
        make_parser("xml")
    assert str(exc.value).startswith("task.tool_parser: unknown tool-call parser 'xml'; valid: json, tag")
    (tmp_path / "myparse.py").write_text(
        "from rlctl.envs.tools import ToolCall\n"
        "class Bang:\n    stop = ('!',)\n"
        "    def parse(self, text):\n"
        "        return ToolCall(text[1:].split()[0], tuple(text.split()[1:])) if text.startswith('!') else None\n"
        "    def format(self, call):\n        return '!' + call.name\n")
    p = make_parser(f"{tmp_path / 'myparse.py'}:Bang")
    assert p.parse("!calc 1 + 1") == ToolCall("calc", ("1", "+", "1")) and p.parse("2") is None


@pytest.mark.parametrize("spec, why", [
    ("collections:OrderedDict", "is not a tool-call parser: it needs parse(text) and stop"),
    ("rlctl.envs.tools:ToolCall", "cannot be made with no arguments: TypeError"),
    ("myparse2.py:OneStop", "stop must be a list of strings, got str"),
])
def test_a_user_parser_that_is_not_one_is_refused_in_one_line(spec, why, tmp_path, monkeypatch):
    (tmp_path / "myparse2.py").write_text(
        "class OneStop:\n    stop = '</end>'\n    def parse(self, text):\n        return None\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as exc:
        make_parser(spec)
    msg = str(exc.value)
    assert msg.startswith(f"task.tool_parser '{spec}' ") and why in msg and "\n" not in msg, msg


def add(a: int, b: int = 10) -> int:
    """Add two integers."""
    return a + b


def scale(x: float, label: str = "", on: bool = True):
    return x, label, on


def test_binding_words_and_json_objects():
    t = make_tool(add)
    assert (t.name, t.params, t.required) == ("add", ("a", "b"), ("a",))
    assert t.source == f"{__name__}:add"
    assert t.bind(["1 2", "3"]) == {"a": 12, "b": 3}       # digit words -> 12
    assert t.bind(["7"]) == {"a": 7}
    assert t.bind({"a": 1, "b": "4 0"}) == {"a": 1, "b": 40}
    s = make_tool(scale)
    assert s.bind({"x": "2 . 5", "on": "false"}) == {"x": 2.5, "on": False}
    one = make_tool(calc)
    assert one.bind(["1", "2", "*", "3"]) == {"expression": "1 2 * 3"}   # one parameter: all words


@pytest.mark.parametrize("args, why", [(["1", "2", "3"], "takes 2 argument"), ([], "takes 2"),
                                       ({"c": 1}, "no parameter 'c'"), ({"b": 1}, "missing argument 'a'"),
                                       (["x"], "a='x' is not a int")])
def test_binding_errors(args, why):
    with pytest.raises(ToolArgumentError, match=why):
        make_tool(add).bind(args)


def test_tools_by_import_path_and_unsandboxable_ones(tmp_path):
    (tmp_path / "mytools.py").write_text("def double(n: int):\n    return 2 * n\n")
    t = make_tool(f"{tmp_path / 'mytools.py'}:double")
    assert t.fn(n=4) == 8 and t.source == f"{tmp_path / 'mytools.py'}:double"
    assert make_tool(lambda x: x).source is None
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        make_tool(f"{tmp_path / 'mytools.py'}:nope")


def test_calc_and_numbers():
    assert calc("1 2 3 * 4 5") == 5535 and calc("123*45") == 5535      # 123 * 45 = 5535
    assert calc("2 + 3 * 4") == 14 and calc("( 2 + 3 ) * 4") == 20 and calc("7 - 9") == -2
    for bad in ("2 ** 3", "1 / 2", "__import__('os')", "", "x", "9" * 201):
        with pytest.raises(ValueError):
            calc(bad)
    with pytest.raises(ValueError, match="digits"):
        calc("*".join(["9" * 30] * 3))
    assert spaced(5535) == "5 5 3 5" and spaced(-12) == "- 1 2" and spaced(0) == "0"
    assert read_number("1 2") == 12 and read_number("- 4") == -4 and read_number(" 7 ") == 7
    assert read_number("5535") == 5535
    for bad in ("", "x", "1 x", "-", "<call> 1 </call>", "١"):
        assert read_number(bad) is None
