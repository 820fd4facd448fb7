"""What the parts of a node's ``Context`` share: the node's identity and where its session stands.

The parts (:mod:`._tool_run`, :mod:`._tool_turn`, :mod:`._llm_request`, :mod:`._conversation`,
:mod:`._structured`) build on :class:`ContextState`; :class:`~._context.Context` composes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tokencake.events import GraphMeta

if TYPE_CHECKING:
    from ._node import Node
    from ._result import NodeResult
    from ._runner import RunState

Message = dict[str, Any]


class ContextState:
    """One node's run state: identity (``node``, ``run_id``, ``agent_type``), the conversation so far
    (``messages``) and the counters its requests and tool calls advance."""

    def __init__(
        self,
        state: RunState,
        node: Node,
        result: NodeResult,
        *,
        name: str | None = None,
        parent: str | None = None,
        slot: Any = None,
    ) -> None:
        self._state = state
        self._slot = slot
        self._node = node
        self._result = result
        self.node = name or node.name
        self.parent = parent
        self.run_id = state.run_id
        self.inputs: Mapping[str, Any] = state.inputs
        self.agent_type = node.agent_type or node.name
        self.messages: list[Message] = []
        self._session_n = 0
        self._turn = 0
        self._next_call = 0  # index into node.calls of the next expected graph-fixed call

    @property
    def session_id(self) -> str:
        """``{run_id}:{node}`` (``#n`` appended after ``new_session=True``)."""
        base = f"{self.run_id}:{self.node}"
        return base if self._session_n == 0 else f"{base}#{self._session_n}"

    @property
    def meta(self) -> GraphMeta:
        return self._state.metas[self.node]

    @property
    def app(self) -> Any:
        return self._state.app
