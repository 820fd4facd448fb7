"""Adapters that give agent frameworks the TokenCake server-side benefit.

Each adapter lives in its own module and imports its framework, so import the one you use:
``tokencake.integrations.openai_agents`` (``pip install 'tokencake[openai-agents]'``),
``tokencake.integrations.langgraph`` (``tokencake[langgraph]``) and
``tokencake.integrations.pydantic_ai`` (``tokencake[pydantic-ai]``). They are built only on the
public integration layer (``tc.Session``, ``tc.stall``, ``tc.TokenCakeTransport``,
``tc.openai_client``); the core package never imports them. ``tc.testing`` runs them offline.
"""
