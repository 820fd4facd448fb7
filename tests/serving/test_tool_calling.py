"""The bundled model's tool-aware chat template and the tool-calling flags ``tokencake serve`` passes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokencake.serving import machine
from tokencake.serving.tool_calling import (
    BUNDLED_PARSER,
    PARSER_PLUGIN,
    bundled_template_path,
    forced_choice_problem,
    parser_for_model,
    tool_calling_args,
)

#: The chat template that comes with the bundled SmolLM2 GGUF (what `tokencake model prepare` writes).
ORIGINAL = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a term up.",
            "parameters": {
                "type": "object",
                "properties": {"term": {"type": "string"}},
                "required": ["term"],
            },
        },
    }
]


def render(template: str, messages: list[dict], **kw: object) -> str:
    """Render as transformers does (sandboxed Jinja, trim/lstrip blocks, ``tojson``)."""
    sandbox = pytest.importorskip("jinja2.sandbox", reason="jinja2 comes with the serve extras")
    env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, **_: json.dumps(x, ensure_ascii=False)
    return env.from_string(template).render(messages=messages, **kw)


@pytest.fixture(scope="module")
def template() -> str:
    return Path(bundled_template_path()).read_text()


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "hi"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "again"},
        ],
    ],
)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_without_tools_the_prompt_is_the_bundled_one(
    template: str, messages: list[dict], generation_prompt: bool
) -> None:
    """Same bytes, same tokens: adding tool support changes nothing for tool-free requests."""
    assert render(template, messages, add_generation_prompt=generation_prompt) == render(
        ORIGINAL, messages, add_generation_prompt=generation_prompt
    )


def test_tools_calls_and_results_are_rendered(template: str) -> None:
    messages = [
        {"role": "user", "content": "What is cake?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"term": "cake"}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": {"term": "pie"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "cake: a sweet"},
        {"role": "tool", "tool_call_id": "c2", "content": "pie: a crust"},
    ]
    text = render(template, messages, tools=TOOLS, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert '<tools>\n{"name": "lookup", "description": "Look a term up."' in text
    assert '<tool_call>\n{"name": "lookup", "arguments": {"term": "cake"}}\n</tool_call>' in text
    assert '\n<tool_call>\n{"name": "lookup", "arguments": {"term": "pie"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>tool\n<tool_response>\ncake: a sweet\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # A system prompt of the caller keeps its text and gets the tool list appended.
    text = render(template, [{"role": "system", "content": "Be brief."}, *messages[:1]], tools=TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")


def test_the_bundled_parser_reads_what_the_template_teaches(template: str) -> None:
    """The bundled parser, loaded as vLLM loads it from the flags, extracts the call format the
    template shows the model."""
    manager = pytest.importorskip("vllm.tool_parsers.abstract_tool_parser").ToolParserManager
    manager.import_tool_parser(PARSER_PLUGIN)

    class Tok:  # the parser only needs a tokenizer object and its vocabulary
        def get_vocab(self) -> dict[str, int]:
            return {}

    parser = manager.get_tool_parser(BUNDLED_PARSER)(Tok())
    shown = render(template, [{"role": "user", "content": "x"}], tools=TOOLS)
    example = shown[shown.index("<tool_call>\n{") : shown.rindex("</tool_call>") + len("</tool_call>")]
    out = parser.extract_tool_calls(
        '<tool_call>\n{"name": "lookup", "arguments": {"term": "cake"}}\n</tool_call>', None
    )
    assert out.tools_called and out.tool_calls[0].function.name == "lookup"
    assert json.loads(out.tool_calls[0].function.arguments) == {"term": "cake"}
    assert parser.extract_tool_calls(example, None).tools_called  # the example itself parses


def test_flags_by_model(tmp_path: Path) -> None:
    args = tool_calling_args(bundled=True, model_dir=tmp_path)
    assert args == [
        "--tool-parser-plugin",
        PARSER_PLUGIN,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        BUNDLED_PARSER,
        "--chat-template",
        bundled_template_path(),
    ]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert parser_for_model(tmp_path) == "hermes"
    assert tool_calling_args(bundled=False, model_dir=tmp_path) == [
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    ]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))  # SmolLM2's architecture
    assert tool_calling_args(bundled=False, model_dir=tmp_path) == []  # no Llama 3 tool tokens assumed
    (tmp_path / "tokencake-model.json").write_text(json.dumps({"name": "smollm2-135m-instruct"}))
    assert tool_calling_args(bundled=False, model_dir=tmp_path)[4] == BUNDLED_PARSER  # given by path
    (tmp_path / "tokencake-model.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert tool_calling_args(bundled=False, model_dir=tmp_path) == []  # unknown family: the user says
    assert tool_calling_args(bundled=False, model_dir=tmp_path, parser="pythonic")[-1] == "pythonic"
    assert tool_calling_args(bundled=True, model_dir=tmp_path, parser="none") == []
    assert tool_calling_args(bundled=True, model_dir=tmp_path, chat_template="t.jinja")[-1] == "t.jinja"
    # The bundled parser named explicitly (for another model) comes with the plugin that registers it.
    assert tool_calling_args(bundled=False, model_dir=tmp_path, parser=BUNDLED_PARSER)[:2] == [
        "--tool-parser-plugin",
        PARSER_PLUGIN,
    ]
    assert "--tool-parser-plugin" not in tool_calling_args(bundled=True, model_dir=tmp_path, parser="hermes")
    # Explicit vLLM flags win: nothing added twice.
    for own in (["--tool-call-parser=llama3_json"], ["--tool-parser-plugin", "my.parser"]):
        assert tool_calling_args(bundled=True, model_dir=tmp_path, extra_args=own) == []
    (tmp_path / "config.json").write_text("{not json")
    assert parser_for_model(tmp_path) is None


def test_forced_choice_problem_by_structured_outputs_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forced calls need a backend that compiles vLLM's structural tags, and its library."""
    monkeypatch.setattr(machine, "module_installed", lambda name: True)
    served = ((None, None), ('{"backend": "xgrammar"}', None), (None, "guidance"), ("{}", None))
    for config, backend in served:
        assert forced_choice_problem(config, backend) is None, (config, backend)
    for config, backend in (('{"backend": "outlines"}', None), (None, "lm-format-enforcer")):
        assert "cannot compile a tool call's grammar" in str(forced_choice_problem(config, backend))
    assert forced_choice_problem('{"backend": "outlines"}', "xgrammar") is None  # vLLM applies .backend last
    monkeypatch.setattr(machine, "module_installed", lambda name: name != "xgrammar")
    assert "pip install xgrammar" in str(forced_choice_problem())
    monkeypatch.setattr(machine, "module_installed", lambda name: name != "llguidance")
    assert forced_choice_problem() is None
    assert "pip install llguidance" in str(forced_choice_problem(backend="guidance"))
