import asyncio
from collections.abc import Callable

import httpx
import pytest

import tokencake as tc


@pytest.fixture
def anyio_backend() -> str:
    # The frameworks under test run on asyncio.
    return "asyncio"


@pytest.fixture
def wire() -> Callable[[tc.ScriptedLLM], httpx.MockTransport]:
    """An httpx transport that lets a ScriptedLLM answer any OpenAI client's requests."""
    return lambda llm: httpx.MockTransport(llm._handle)


@pytest.fixture
def wire_sync() -> Callable[[tc.ScriptedLLM], httpx.MockTransport]:
    """The same for sync clients (the scripted model answers without awaiting anything)."""
    return lambda llm: httpx.MockTransport(lambda request: asyncio.run(llm._handle(request)))
