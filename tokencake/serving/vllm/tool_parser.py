"""The bundled model's tool-call parser: vLLM's ``hermes`` parser, with forced calls held to the schema.

vLLM loads this module with ``--tool-parser-plugin tokencake.serving.vllm.tool_parser`` and uses the
parser as ``--tool-call-parser tokencake_hermes`` (``tokencake serve`` passes both for the bundled
SmolLM2; see ``tokencake.serving.tool_calling``). Parsing is vLLM's hermes parser unchanged; the
rules below only shape what the model may write:

* **Argument schemas are enforced** (``default_tool_strict_level`` PARAMETER: as if every tool
  were ``strict: true``). vLLM's structural tag for a forced turn (``tool_choice="required"`` or a
  named function) otherwise fixes the ``<tool_call>`` envelope and the function name only, and the
  135M model fills the arguments with copies of the schema or ``{"argument": "value"}``. With
  ``tool_choice="auto"`` the text stays free until the model opens a ``<tool_call>``.
* **Forced turns default to** ``frequency_penalty`` = :data:`FORCED_FREQUENCY_PENALTY` when the
  request gives none: greedy decoding inside a constrained string or array loops
  (``"2017-2017-2017…"``) until ``max_tokens``, and the cut-off call is unparsable. The penalty
  counts generated tokens only, so the chat markup of the prompt keeps its weight.
* **When this server cannot constrain a forced turn** (``tokencake serve`` found why at start and
  put the reason in ``$TOKENCAKE_FORCED_TOOLS_UNAVAILABLE``), a forced request is answered
  HTTP 400 with that reason instead of unconstrained text, and ``auto`` turns get no grammar
  (vLLM's default: the backend would fail on it).
"""

from __future__ import annotations

import os
from typing import Any

from vllm.exceptions import VLLMValidationError
from vllm.logger import init_logger
from vllm.tool_parsers.abstract_tool_parser import ToolParserManager
from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from vllm.tool_parsers.tool_strict_level import ToolStrictLevel

from tokencake.serving.tool_calling import BUNDLED_PARSER, FORCED_UNAVAILABLE_ENV

__all__ = ["FORCED_FREQUENCY_PENALTY", "TokenCakeHermesToolParser", "is_forced"]

logger = init_logger(__name__)

#: ``frequency_penalty`` of a forced turn that sets none. Over the 50 forced turns of
#: ``benchmarks/forced_tool_calls.py`` (float32): 0 → 68 % schema-valid, 0.3 → 96 %, 0.5 and 1.0 → 100 %.
FORCED_FREQUENCY_PENALTY = 0.5


def is_forced(request: Any) -> bool:
    """Whether ``request`` offers tools and forces a call (``"required"`` or a named function)."""
    choice = getattr(request, "tool_choice", None)
    if not getattr(request, "tools", None) or choice in (None, "none", "auto"):
        return False
    return getattr(choice, "mode", None) != "auto"  # Responses' allowed_tools in auto mode


@ToolParserManager.register_module(BUNDLED_PARSER)
class TokenCakeHermesToolParser(Hermes2ProToolParser):
    """vLLM's hermes parser with the module's rules for forced turns."""

    @property  # type: ignore[override]
    def default_tool_strict_level(self) -> ToolStrictLevel | None:
        """PARAMETER; vLLM's default (None) on a server that cannot compile structural tags, so
        that ``tool_choice="auto"`` gets no tag there and is served as by the stock parser."""
        return None if os.environ.get(FORCED_UNAVAILABLE_ENV) else ToolStrictLevel.PARAMETER

    def adjust_request(self, request: Any) -> Any:
        """vLLM's adjustment, then: refuse a forced turn this server cannot constrain, or give it
        the default ``frequency_penalty`` when it sets none."""
        request = super().adjust_request(request)
        if not is_forced(request):
            return request
        reason = os.environ.get(FORCED_UNAVAILABLE_ENV)
        if reason:
            raise VLLMValidationError(
                f"tool_choice forces a call, but this server cannot constrain it: {reason}",
                parameter="tool_choice",
            )
        if getattr(request, "frequency_penalty", 0.0) is None:
            request.frequency_penalty = FORCED_FREQUENCY_PENALTY
        return request


if os.environ.get(FORCED_UNAVAILABLE_ENV):
    logger.warning(
        "forced tool choice (tool_choice 'required' or a named function) is refused with HTTP 400: %s",
        os.environ[FORCED_UNAVAILABLE_ENV],
    )
