"""The catalog registry: names, descriptions, parameters and errors."""

from __future__ import annotations

import pytest

import tokencake as tc
from tokencake.agents import catalog


def test_list_apps_describes_every_app() -> None:
    infos = catalog.list_apps()
    assert [i.name for i in infos] == ["code-writer", "deep-research", "rag", "map-reduce", "tool-agent"]
    by_name = {i.name: i for i in infos}
    assert by_name["code-writer"].nodes == 29
    assert by_name["deep-research"].nodes == 10  # planner + 3 x 2 + synthesizer, critic, writer
    assert by_name["rag"].nodes == 1
    assert by_name["map-reduce"].nodes == 8
    assert by_name["tool-agent"].nodes == 3
    for info in infos:
        assert info.shape and info.description and "\n" not in info.description
        assert list(info.inputs) == ["task"] and info.inputs["task"].strip()
        assert {"latency", "seed", "noise", "workdir"} <= set(info.params)
        assert info.to_dict()["name"] == info.name


def test_get_app_returns_fresh_valid_apps() -> None:
    for name in catalog.app_names():
        a, b = catalog.get_app(name), catalog.get_app(name)
        assert isinstance(a, tc.App) and a is not b
        a.validate()
        assert a.inputs == ["task"]


def test_unknown_app_lists_the_available_ones() -> None:
    with pytest.raises(catalog.UnknownApp) as info:
        catalog.get_app("code-writr")
    message = str(info.value)
    assert "code-writr" in message
    for name in catalog.app_names():
        assert name in message


def test_bad_parameters_are_clear_errors() -> None:
    with pytest.raises(TypeError, match=r"no parameter 'branch'.*branches"):
        catalog.get_app("deep-research", branch=3)
    with pytest.raises(ValueError, match="branches"):
        catalog.get_app("deep-research", branches=0)
    with pytest.raises(ValueError, match="width"):
        catalog.get_app("map-reduce", width=100)
    with pytest.raises(ValueError, match="unknown latency"):
        catalog.get_app("rag", latency="fast")


def test_app_parameters_change_the_shape() -> None:
    assert len(catalog.get_app("deep-research", branches=6).nodes) == 1 + 6 * 2 + 3
    assert len(catalog.get_app("map-reduce", width=12).nodes) == 14


def test_scripted_llm_is_a_real_llm() -> None:
    llm = catalog.scripted_llm("rag")
    assert isinstance(llm, tc.ScriptedLLM) and isinstance(llm, tc.LLM)
    assert callable(catalog.scripted_replies("rag"))


def test_token_scale_shrinks_every_budget() -> None:
    full = catalog.get_app("code-writer")
    short = catalog.get_app("code-writer", token_scale=0.25)
    for name, node in full.nodes.items():
        if node.kind == "agent":
            assert short.nodes[name].max_tokens == max(8, round(node.max_tokens * 0.25))
    assert short.critical_path_s < full.critical_path_s
    with pytest.raises(ValueError, match="token_scale"):
        catalog.get_app("rag", token_scale=0)


def test_agents_are_greedy_and_prose_agents_have_a_repetition_penalty() -> None:
    from tokencake.agents.catalog._env import SAMPLING

    penalty = SAMPLING["extra_body"]["repetition_penalty"]
    assert penalty > 1.0
    for name in catalog.app_names():
        for node in catalog.get_app(name).nodes.values():
            if node.kind != "agent":
                continue
            assert node.temperature == 0.0, (name, node.name)
            calls_tools = bool(node.tools)  # its replies are tool calls: no penalty on their JSON
            expected = None if calls_tools else {"repetition_penalty": penalty}
            assert node.extra_body == expected, (name, node.name)
