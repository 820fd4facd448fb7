"""The adapters' examples (examples/*.py) run offline on ``tc.testing``, and docs/integrations.md shows
them as they are: each ``--8<--`` region of an example file is a code block of the docs."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = (ROOT / "docs" / "integrations.md").read_text()
#: example file -> the framework it needs
EXAMPLES = {
    "openai_agents_weather": "agents",
    "langgraph_research": "langchain.agents",
    "pydantic_ai_research": "pydantic_ai",
}
REGION = re.compile(r"# --8<-- \[start:(\w+)\]\n(.*?)# --8<-- \[end:\1\]\n", re.S)


def _load(name: str):
    spec = importlib.util.spec_from_file_location(
        f"tokencake_example_{name}", ROOT / "examples" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and typing look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_docs_show_each_example_region_verbatim(name):
    regions = dict(REGION.findall((ROOT / "examples" / f"{name}.py").read_text()))
    assert set(regions) == {"agent", "test"}
    for part, code in regions.items():
        assert f"```python\n{code.rstrip()}\n```" in DOCS, (
            f"{name}: its '{part}' region differs from the docs"
        )


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_example_runs_offline(name, capsys, monkeypatch):
    library = EXAMPLES[name]
    pytest.importorskip(library)
    for var in ("TOKENCAKE_BASE_URL", "TOKENCAKE_EVENTS_URL", "TOKENCAKE_MODEL"):
        monkeypatch.delenv(var, raising=False)
    module = _load(name)
    try:
        assert module.main(["--offline"]) == 0
    finally:
        sys.modules.pop(module.__name__, None)
        if library == "agents":
            import agents

            agents.set_tracing_disabled(False)  # main() turned it off for the run
    assert capsys.readouterr().out == "offline: 4 stamped requests, 2 closed stalls\n"
