import enum
from typing import Literal, Optional

import jsonschema
import pytest
from pydantic import BaseModel

import tokencake as tc
from tokencake.agents._schema import parse_docstring


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Point(BaseModel):
    x: int
    y: int = 0


def _tool(fn, **opts) -> tc.Tool:
    app = tc.App("schema")
    return app.add_tool(fn, **opts)


def test_scalar_enum_optional_list_and_model_parameters():
    def paint(
        count: int,
        color: Color,
        label: Optional[str] = None,  # noqa: UP045 - the typing spelling must work too
        tags: list[str] | None = None,
        points: list[Point] = (),
        mode: Literal["fast", "slow"] = "fast",
        ratio: float = 0.5,
        dry_run: bool = False,
    ) -> str:
        """Paint some points.

        Longer explanation of the tool.

        Args:
            count: how many coats
                of paint (continued line).
            color (Color): the paint color.
            label: optional label.
            tags: free-form tags.
            points: where to paint.

        Returns:
            A receipt.
        """
        return "ok"

    tool = _tool(paint)
    schema = tool.openai_schema()
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "paint"
    assert fn["description"] == "Paint some points.\n\nLonger explanation of the tool."
    params = fn["parameters"]
    jsonschema.Draft202012Validator.check_schema(params)
    props = params["properties"]
    assert params["type"] == "object"
    assert params["required"] == ["count", "color"]
    assert props["count"]["type"] == "integer"
    assert props["count"]["description"] == "how many coats of paint (continued line)."
    assert props["color"]["description"] == "the paint color."
    color_schema = params["$defs"]["Color"]
    assert color_schema["enum"] == ["red", "green"]
    assert {"type": "null"} in props["label"]["anyOf"]
    assert {"type": "string"} in props["label"]["anyOf"]
    assert props["label"]["default"] is None
    assert props["tags"]["anyOf"][0] == {"items": {"type": "string"}, "type": "array"}
    assert props["points"]["items"] == {"$ref": "#/$defs/Point"}
    assert params["$defs"]["Point"]["required"] == ["x"]
    assert props["mode"]["enum"] == ["fast", "slow"]
    assert props["ratio"]["type"] == "number"
    assert props["dry_run"]["type"] == "boolean"
    assert "title" not in props["count"]
    assert "Returns" not in fn["description"]

    good = {"count": 2, "color": "red", "points": [{"x": 1}], "tags": ["a"]}
    jsonschema.validate(good, params)
    args = tool.validate(good)
    assert args["color"] is Color.RED
    assert args["points"] == [Point(x=1, y=0)]
    assert args["label"] is None and args["mode"] == "fast"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"count": 2, "color": "blue"}, params)


def test_validation_errors_name_the_tool_and_fields():
    def add(a: int, b: int) -> int:
        return a + b

    tool = _tool(add)
    assert tool.validate({"a": "3", "b": 4}) == {"a": 3, "b": 4}  # lax JSON-style coercion
    with pytest.raises(tc.ToolArgumentsError) as info:
        tool.validate({"a": "x", "c": 1})
    msg = str(info.value)
    assert "'add'" in msg
    assert "a: Input should be a valid integer" in msg
    assert "b: Field required" in msg
    assert "c: Extra inputs are not permitted" in msg
    assert info.value.tool == "add"
    assert isinstance(info.value, tc.ToolError) and isinstance(info.value, ValueError)
    with pytest.raises(tc.ToolArgumentsError, match="JSON object"):
        tool.validate(["not", "a", "dict"])


@pytest.mark.parametrize(
    ("fn_src", "needle"),
    [
        ("def f(a, b: int): ...", "parameter 'a' of 'f' has no type hint"),
        ("def f(*items: int): ...", "*items"),
        ("def f(**kw: int): ...", "**kw"),
        ("def f(sock: Opaque): ...", "parameter 'sock' of 'f'"),
    ],
)
def test_unschematizable_tool_is_rejected_at_declaration(fn_src, needle):
    class Opaque:  # an arbitrary class has no JSON schema
        pass

    namespace: dict = {"Opaque": Opaque}
    exec(fn_src, namespace)
    app = tc.App("bad")
    with pytest.raises(tc.AppDefinitionError) as info:
        app.tool(namespace["f"])
    assert needle in str(info.value)
    assert "'f'" in str(info.value)
    assert "f" not in app.tools


def test_unresolvable_forward_reference_is_an_error():
    def f(x: "DoesNotExist") -> None:  # noqa: F821
        pass

    with pytest.raises(tc.AppDefinitionError, match="cannot resolve the type hints of 'f'"):
        tc.App("x").tool(f)


def test_positional_only_parameters_are_passed_positionally():
    def div(a: int, b: int, /) -> float:
        return a / b

    tool = _tool(div)
    assert tool.parameters["required"] == ["a", "b"]


def test_parse_docstring_google_and_sphinx():
    desc, args = parse_docstring(
        """Summary line.

        Args:
            x (int): first
                second line
            y: other

        Raises:
            ValueError: never
        """
    )
    assert desc == "Summary line."
    assert args == {"x": "first second line", "y": "other"}
    desc, args = parse_docstring("Do it.\n\n:param a: the a\n:param int b: the b\n")
    assert desc == "Do it."
    assert args == {"a": "the a", "b": "the b"}
    assert parse_docstring(None) == ("", {})


def test_description_defaults_and_timing_hints():
    def look(q: str) -> str:
        return q

    tool = _tool(look, stages={"query": 0.5, "execute": 1, "results": 0.5}, kind="search")
    assert tool.description == "look"  # no docstring: the name
    assert tool.predicted_s == 2.0  # no predict_time: the stages' sum
    tool2 = tc.App("y").add_tool(look, predict_time=4.0, stages={"a": 1.0}, description="Find.")
    assert tool2.predicted_s == 4.0
    assert tool2.openai_schema()["function"]["description"] == "Find."


@pytest.mark.parametrize(
    ("opts", "needle"),
    [
        ({"name": "bad name!"}, "OpenAI"),
        ({"predict_time": -1}, "predict_time"),
        ({"timeout": 0}, "timeout"),
        ({"retries": -1}, "retries"),
        ({"stages": {"a": -1}}, "stages"),
    ],
)
def test_bad_tool_options(opts, needle):
    def f(x: int) -> int:
        return x

    with pytest.raises(tc.AppDefinitionError, match=needle):
        tc.App("z").add_tool(f, **opts)
