"""code-writer: TokenCake's evaluation DAG, with tools that really write, validate and test code.

The shape follows the published Code-Writer workload (29 nodes, 36 edges, depth 17; see
``docs/apps.md``): two planning rounds (architect → search → judger), a file plan that fans out to
three programmers (patch → validation → repair → file write), two reviewers joining the three
programmers, two revisers (patch → validation → repair → guarded write), an external evaluation,
a simulated user confirmation and a final test stage. Output-token budgets (``max_tokens``) and
tool ``predict_time``/``stages`` are the published ones.

Every tool works in the run's sandbox directory: files are really written, patches are validated
by compiling them and running their tests in a subprocess on a scratch copy, and searches rank
the bundled corpus. A model that writes broken code (small models do) produces failed
validations and failing tests — reported in the output, never a crash.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import tokencake as tc
from tokencake.agents.catalog._env import EnvOptions, new_app
from tokencake.agents.catalog.code_writer._dag import add_nodes
from tokencake.agents.catalog.code_writer._script import script
from tokencake.agents.catalog.code_writer._tools import add_tools

if TYPE_CHECKING:
    from typing_extensions import Unpack

NAME = "code-writer"
SHAPE = "deep DAG: 2 planning rounds → 3 programmers → 2 reviewers → 2 revisers → eval → test"
DESCRIPTION = (
    "TokenCake's Code-Writer DAG: plans, writes, validates, reviews and tests Python code in a sandbox."
)
DEFAULT_TASK = (
    "Build a small Python toolkit for closed integer ranges written like '3-7': parse a comma-separated "
    "list of ranges, merge overlapping ranges and measure coverage, and format a coverage report. "
    "Put each part in its own module with plain-assert tests."
)
DEFAULT_INPUTS = {"task": DEFAULT_TASK}


def build(
    *,
    test_timeout: float = 30.0,
    **options: Unpack[EnvOptions],
) -> tc.App:
    """The code-writer app (see the module docstring); ``test_timeout`` bounds each test subprocess."""
    env, app = new_app(NAME, DESCRIPTION, **options)
    add_tools(app, env, test_timeout=test_timeout)
    add_nodes(app, env)
    return app


def final_answer(output: dict[str, Any]) -> str:
    """The run's result in a few lines, for terminals."""
    tests = output.get("tests", {})
    verdict = "pass" if output.get("tests_passed") else "FAIL"
    return (
        f"{output.get('summary', '')}\n\nTests: {tests.get('summary', '?')} ({verdict}); "
        f"user approved: {output.get('approved')}\nFiles in {output.get('sandbox')}: "
        + ", ".join(output.get("files", []))
    )


__all__ = [
    "DEFAULT_INPUTS",
    "DEFAULT_TASK",
    "DESCRIPTION",
    "NAME",
    "SHAPE",
    "build",
    "final_answer",
    "script",
]
