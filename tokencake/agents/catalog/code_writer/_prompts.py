"""What code-writer's agents are told and carry: system prompts, the existing project they extend
and how many tokens of material (style guide, modules, logs, search pages, code) each level gives."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokencake.agents.catalog._env import AppEnv

#: Estimated tokens of what the agents carry, per ``context`` level. At ``realistic`` a programmer
#: chain (patch → repair, one conversation) holds the task, the design, the style guide, the existing
#: module it builds on, its patch, the full test output and its repair: ~2,450 tokens.
SIZES: dict[str, dict[str, int]] = {
    "style": {"small": 80, "realistic": 300},  # CONTRIBUTING.md, in every programmer's prompt
    "module": {"small": 150, "realistic": 550},  # each existing project/*.py module
    "log": {"small": 150, "realistic": 550},  # test output of a validation
    "excerpt": {"small": 60, "realistic": 380},  # page text of each web_search hit
    "review_code": {"small": 1000, "realistic": 1900},  # code a reviewer reads
    "revise_code": {"small": 700, "realistic": 1000},  # code a reviser reads
}
#: The existing project the programmers extend (seeded; valid, documented Python).
PROJECT_MODULES = ("project/text_utils.py", "project/io_helpers.py", "project/checks.py")
#: Characters per estimated token of code, to turn a token budget into format_files' char caps.
CODE_CHARS = 3.2

_FILE_FORMAT = (
    "Write each file as a line `# file: PATH` followed by a ```python fenced block with the whole file. "
    "Tests are plain functions named test_* using assert (no pytest imports)."
)
SYSTEMS = {
    "architect": "You are a software architect. You design small, testable Python modules.",
    "search": "You turn a design into one short keyword search query. Reply with the query only.",
    "judger": "You judge designs. Start your answer with APPROVE or REVISE, then give one reason.",
    "planner": "You assign files. Reply with exactly three numbered lines `N. module.py: purpose`.",
    "programmer": "You are a careful Python programmer. " + _FILE_FORMAT,
    "writer": "You write one-line commit messages.",
    "reviewer": "You review Python code. Be specific and brief.",
    "reviser": "You improve reviewed Python code. "
    + _FILE_FORMAT
    + " Reply NO CHANGES if nothing is needed.",
    "evaluator": "You plan an external evaluation of a code change in one or two sentences.",
    "confirm": "You summarise a finished code change for the user in two sentences.",
    "tester": "You plan the final test run in one sentence.",
}


def size(env: AppEnv, what: str) -> int:
    """Estimated tokens of ``what`` (a :data:`SIZES` row) at the app's ``context`` level."""
    return env.size(SIZES[what])
