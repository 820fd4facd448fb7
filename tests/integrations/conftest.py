from collections.abc import Callable

import pytest

import tokencake as tc


@pytest.fixture
def anyio_backend() -> str:
    # The frameworks under test run on asyncio.
    return "asyncio"


@pytest.fixture
def wire() -> Callable[[tc.ScriptedLLM], tc.testing.ScriptedTransport]:
    """An httpx transport (sync and async) that lets a ScriptedLLM answer any OpenAI client's requests."""
    return tc.testing.ScriptedTransport
