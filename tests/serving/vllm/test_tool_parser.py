"""The bundled model's tool-call parser inside vLLM's parser stack: what a forced turn may generate.

The request goes through the parser vLLM composes from ``--tool-call-parser`` (``adjust_request``:
the structural tag, then the parser's own rules); the tag is compiled by xgrammar and asked
whether it accepts a call, as the engine's grammar matcher would.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")
xgr = pytest.importorskip("xgrammar")

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # noqa: E402
from vllm.exceptions import VLLMValidationError  # noqa: E402
from vllm.parser.parser_manager import ParserManager  # noqa: E402
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402

from tokencake.serving.tool_calling import BUNDLED_PARSER, FORCED_UNAVAILABLE_ENV  # noqa: E402
from tokencake.serving.vllm.tool_parser import (  # noqa: E402
    FORCED_FREQUENCY_PENALTY,
    TokenCakeHermesToolParser,
    is_forced,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a term up.",
            "parameters": {
                "type": "object",
                "properties": {"term": {"type": "string"}, "limit": {"type": "integer", "minimum": 1}},
                "required": ["term"],
            },
        },
    }
]
NAMED = {"type": "function", "function": {"name": "lookup"}}
VALID = '<tool_call>\n{"name": "lookup", "arguments": {"term": "cake", "limit": 3}}\n</tool_call>'
OFF_SCHEMA = [
    '<tool_call>\n{"name": "lookup", "arguments": {"argument": "value"}}\n</tool_call>',
    '<tool_call>\n{"name": "lookup", "arguments": {"term": "cake", "limit": 0}}\n</tool_call>',
    '<tool_call>\n{"name": "lookup", "arguments": {"type": "object", "properties": {}}}\n</tool_call>',
]


class _Tok:  # the parsers only need a tokenizer object and its vocabulary
    def get_vocab(self) -> dict[str, int]:
        return {}


def adjusted(parser_name: str, tool_choice: Any, **fields: Any) -> ChatCompletionRequest:
    """``request`` after vLLM's parser stack for ``--tool-call-parser parser_name`` adjusted it."""
    request = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "x"}], tools=TOOLS, tool_choice=tool_choice, **fields
    )
    parser_cls = ParserManager.get_parser(tool_parser_name=parser_name, enable_auto_tools=True)
    return parser_cls(_Tok(), request.tools).adjust_request(request)


def grammar(request: ChatCompletionRequest) -> Any:
    assert request.structured_outputs is not None and request.structured_outputs.structural_tag
    return xgr.Grammar.from_structural_tag(request.structured_outputs.structural_tag)


def test_registered_under_the_bundled_name() -> None:
    from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

    assert ToolParserManager.get_tool_parser(BUNDLED_PARSER) is TokenCakeHermesToolParser


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_a_forced_turn_may_only_generate_schema_valid_arguments(tool_choice: Any) -> None:
    """The defect: vLLM's hermes tag fixes the envelope only; arguments outside the schema pass."""
    stock = grammar(adjusted("hermes", tool_choice))
    assert all(_is_grammar_accept_string(stock, text) for text in OFF_SCHEMA)  # what the issue saw
    ours = grammar(adjusted(BUNDLED_PARSER, tool_choice))
    assert _is_grammar_accept_string(ours, VALID)
    assert _is_grammar_accept_string(ours, VALID.replace(', "limit": 3', ""))  # optional field
    for text in [*OFF_SCHEMA, "plain text", VALID.replace("lookup", "other")]:
        assert not _is_grammar_accept_string(ours, text), text


def test_forced_turns_get_the_default_frequency_penalty_unless_they_set_one() -> None:
    for choice in ("required", NAMED):
        assert adjusted(BUNDLED_PARSER, choice).frequency_penalty == FORCED_FREQUENCY_PENALTY
        assert adjusted(BUNDLED_PARSER, choice, frequency_penalty=0.0).frequency_penalty == 0.0
        assert adjusted(BUNDLED_PARSER, choice, frequency_penalty=1.5).frequency_penalty == 1.5
    assert adjusted(BUNDLED_PARSER, "auto").frequency_penalty is None
    assert adjusted("hermes", "required").frequency_penalty is None  # the stock parser is unchanged


def test_auto_stays_free_text_until_a_call_opens() -> None:
    auto = grammar(adjusted(BUNDLED_PARSER, "auto"))
    assert _is_grammar_accept_string(auto, "It is sunny.")
    assert _is_grammar_accept_string(auto, "Let me look. " + VALID)
    assert not _is_grammar_accept_string(auto, "Let me look. " + OFF_SCHEMA[0])


def test_a_server_that_cannot_constrain_refuses_forced_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FORCED_UNAVAILABLE_ENV, "the structured-outputs backend 'outlines' cannot")
    for choice in ("required", NAMED):
        with pytest.raises(VLLMValidationError, match="cannot constrain it: the structured-outputs backend"):
            adjusted(BUNDLED_PARSER, choice)
    auto = adjusted(BUNDLED_PARSER, "auto")  # served as by the stock parser: no grammar to compile
    assert auto.tool_choice == "auto" and auto.structured_outputs is None


def test_is_forced() -> None:
    class Req:
        def __init__(self, tools: Any, tool_choice: Any) -> None:
            self.tools, self.tool_choice = tools, tool_choice

    class Allowed:
        def __init__(self, mode: str) -> None:
            self.mode = mode

    assert is_forced(Req(TOOLS, "required")) and is_forced(Req(TOOLS, NAMED))
    assert is_forced(Req(TOOLS, Allowed("required")))
    free = ((TOOLS, "auto"), (TOOLS, "none"), (TOOLS, None), (None, "required"), (TOOLS, Allowed("auto")))
    for tools, choice in free:
        assert not is_forced(Req(tools, choice)), (tools, choice)
