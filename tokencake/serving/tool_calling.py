"""Which tool-call parser and chat template ``tokencake serve`` gives vLLM, so ``tools=`` works.

OpenAI-compatible agent frameworks (OpenAI Agents SDK, LangGraph, Pydantic AI) send ``tools`` with
``tool_choice="auto"``; vLLM answers 400 unless it runs with ``--enable-auto-tool-choice`` and a
``--tool-call-parser`` that matches what the model writes. The rule:

* the bundled SmolLM2 (by name, or a directory ``tokencake model prepare`` made): its own chat
  template renders neither ``tools`` nor an assistant's ``tool_calls`` (it concatenates
  ``content``, which is null there), so the server uses ``templates/smollm2_tools.jinja`` — the
  same ChatML, plus tools in the Hermes format — and the ``tokencake_hermes`` parser
  (``tokencake/serving/vllm/tool_parser.py``, loaded with ``--tool-parser-plugin``): vLLM's
  ``hermes`` parser whose forced calls (``tool_choice="required"`` or a named function) keep to
  the tools' schemas. Conversations without tools render exactly as before;
* another model: the parser of its family from ``config.json`` (below), with the model's own
  template; a family not listed gets none (say ``--tool-call-parser NAME``);
* ``tool_call_parser="none"`` turns tool calling off; explicit vLLM flags in ``extra_args`` win.

Forced calls are constrained by vLLM's structured outputs (a structural tag compiled by xgrammar
or llguidance). :func:`forced_choice_problem` says why a server cannot (another backend, a
missing library); ``tokencake serve`` then says so at start, and the bundled parser answers
forced requests with HTTP 400 and the reason (``FORCED_UNAVAILABLE_ENV``).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from tokencake.serving import machine

__all__ = [
    "BUNDLED_PARSER",
    "FORCED_UNAVAILABLE_ENV",
    "PARSER_PLUGIN",
    "bundled_template_path",
    "forced_choice_problem",
    "is_bundled_dir",
    "parser_for_model",
    "tool_calling_args",
]

#: The bundled model's parser: reads the Hermes format ``templates/smollm2_tools.jinja`` teaches.
BUNDLED_PARSER = "tokencake_hermes"
#: The module that registers :data:`BUNDLED_PARSER` in vLLM (``--tool-parser-plugin``).
PARSER_PLUGIN = "tokencake.serving.vllm.tool_parser"
#: Environment variable of the vLLM process: why forced tool choice is refused (unset: served).
FORCED_UNAVAILABLE_ENV = "TOKENCAKE_FORCED_TOOLS_UNAVAILABLE"

#: Structured-outputs backend → the libraries vLLM needs to compile a forced call's structural tag
#: (vLLM builds the tag with xgrammar's types whatever the backend). Others (outlines,
#: lm-format-enforcer) cannot compile structural tags: the request fails inside the engine.
_TAG_BACKENDS: dict[str, tuple[str, ...]] = {
    "auto": ("xgrammar",),
    "xgrammar": ("xgrammar",),
    "guidance": ("xgrammar", "llguidance"),
}

#: ``model_type`` of a model's config.json → the vLLM parser its chat template's format matches.
#: Only families whose parser needs no special tokens of its own: many models share an
#: architecture (SmolLM2 is ``llama``) without sharing Llama 3's or Mistral's tool tokens, and a
#: parser whose tokens are missing stops vLLM at start-up. Others: ``--tool-call-parser NAME``.
_FAMILY_PARSERS: dict[str, str] = {
    "qwen2": "hermes",
    "qwen2_moe": "hermes",
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
}

#: The marker ``tokencake model prepare`` writes into the bundled model's directory.
_BUNDLED_MARKER = "tokencake-model.json"
_BUNDLED_NAME = "smollm2-135m-instruct"


def is_bundled_dir(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` is a prepared copy of the bundled model (however it was named)."""
    try:
        info = json.loads((Path(model_dir) / _BUNDLED_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("name") == _BUNDLED_NAME


_OWN_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "--tool-parser-plugin", "--chat-template")


def bundled_template_path() -> str:
    """Path of the chat template shipped for the bundled model (inside the installed package)."""
    return str(resources.files("tokencake.serving") / "templates" / "smollm2_tools.jinja")


def parser_for_model(model_dir: str | Path) -> str | None:
    """The parser for a model directory's family, or None (unknown family, no readable config)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return _FAMILY_PARSERS.get(str(config.get("model_type", "")).lower())


def tool_calling_args(
    *,
    bundled: bool,
    model_dir: str | Path,
    parser: str | None = "auto",
    chat_template: str | None = None,
    extra_args: list[str] | tuple[str, ...] = (),
) -> list[str]:
    """vLLM flags for tool calling (see the module docstring); [] when off or already given."""
    if any(a == flag or a.startswith(flag + "=") for a in extra_args for flag in _OWN_FLAGS):
        return []  # the user drives vLLM's tool flags directly
    if parser is None or parser == "none":
        return [] if chat_template is None else ["--chat-template", chat_template]
    bundled = bundled or is_bundled_dir(model_dir)
    if parser == "auto":
        parser = BUNDLED_PARSER if bundled else parser_for_model(model_dir)
    template = chat_template if chat_template is not None else (bundled_template_path() if bundled else None)
    args = [] if parser is None else ["--enable-auto-tool-choice", "--tool-call-parser", parser]
    if parser == BUNDLED_PARSER:
        args = ["--tool-parser-plugin", PARSER_PLUGIN, *args]
    if template is not None:
        args += ["--chat-template", template]
    return args


def forced_choice_problem(config: str | None = None, backend: str | None = None) -> str | None:
    """Why vLLM cannot constrain a forced tool call under ``--structured-outputs-config`` (its JSON
    ``config``, or the ``backend`` given as ``--structured-outputs-config.backend``); None: it can."""
    if backend is None and config:
        try:
            backend = json.loads(config).get("backend")
        except (ValueError, AttributeError):
            backend = None
    backend = backend or "auto"
    if backend not in _TAG_BACKENDS:
        return (
            f"the structured-outputs backend {backend!r} cannot compile a tool call's grammar "
            f"(structural tag); use {', '.join(repr(b) for b in _TAG_BACKENDS)}"
        )
    missing = [name for name in _TAG_BACKENDS[backend] if not machine.module_installed(name)]
    if missing:
        return f"{' and '.join(missing)} (structured outputs) not installed: pip install {' '.join(missing)}"
    return None
