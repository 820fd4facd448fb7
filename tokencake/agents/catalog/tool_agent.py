"""tool-agent: a model-driven SWE-style loop over a small buggy project in the run's sandbox.

``setup`` seeds the sandbox with a module whose tests fail; ``swe_agent`` gets the task and five
tools through the OpenAI tools API (list, read and write files, run the tests, search the docs)
and decides itself what to call, turn after turn (``ctx.llm(..., tools=..., max_turns=...)``);
``verify`` runs the tests once more and reports whether the fix holds.

Servers started without a tool-call parser reject requests that offer tools; the agent then
falls back to a plain-text protocol (``CALL tool {json}`` lines) over the same tools, so the app
still runs — and still stalls on every tool call — against any OpenAI-compatible endpoint.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import openai

import tokencake as tc
from tokencake.agents.catalog._env import EnvOptions, new_app
from tokencake.agents.catalog._material import document_text, prose, rng_for, runner_log
from tokencake.agents.catalog._sandbox import SandboxError
from tokencake.agents.catalog._text import clip

if TYPE_CHECKING:
    from typing_extensions import Unpack

NAME = "tool-agent"
SHAPE = "agent loop: setup → agent (model-chosen tool calls, up to max_turns) → verify"
DESCRIPTION = "SWE-style agent: the model reads code, runs tests and edits files through OpenAI tool calls."
DEFAULT_TASK = (
    "The tests in test_textutils.py fail. Find the bug in textutils.py and fix it so that all tests pass."
)
DEFAULT_INPUTS = {"task": DEFAULT_TASK}

T_LIST, T_READ, T_WRITE, T_TEST, T_SEARCH = 0.2, 0.3, 0.3, 3.0, 2.0
TOOLS = ["list_files", "read_file", "write_file", "run_tests", "search_docs"]

#: The project the agent has to fix: word_count splits on single spaces.
SEED_FILES = {
    "textutils.py": '''"""Small text helpers."""


def word_count(text):
    """Number of words separated by whitespace."""
    return len(text.split(" "))


def slugify(title):
    """Lower-case words joined by dashes."""
    return "-".join(title.lower().split())
''',
    "test_textutils.py": """from textutils import slugify, word_count


def test_word_count_simple():
    assert word_count("one two three") == 3


def test_word_count_extra_spaces():
    assert word_count("  one   two ") == 2


def test_word_count_empty():
    assert word_count("") == 0


def test_slugify():
    assert slugify("Hello  World") == "hello-world"
""",
}
#: Estimated tokens of what the tools return, per ``context`` level: the project's README (the agent
#: reads it first), each test run's output and each search hit's page text. The scripted trajectory
#: (list, read README, read the module, test, search, fix, test) ends at ~2,800 tokens at ``realistic``.
SIZES: dict[str, dict[str, int]] = {
    "readme": {"small": 120, "realistic": 480},
    "log": {"small": 120, "realistic": 360},
    "excerpt": {"small": 40, "realistic": 170},
}
_CALL = re.compile(r"CALL\s+([A-Za-z_]\w*)\s*(\{.*\})?", re.S)
_TEXT_PROTOCOL = (
    "You fix code in a small Python project by using tools. Tools: list_files(), read_file(path), "
    "write_file(path, content), run_tests(), search_docs(query). To use one, reply with exactly one line "
    'CALL tool_name {"arg": "value"} and nothing else; you will get the result. When you are done, '
    "reply with DONE followed by a one-sentence summary."
)


def build(
    *,
    max_turns: int = 10,
    test_timeout: float = 30.0,
    **options: Unpack[EnvOptions],
) -> tc.App:
    """The tool-agent app; the model gets at most ``max_turns`` requests (2..40)."""
    if not isinstance(max_turns, int) or not 2 <= max_turns <= 40:
        raise ValueError(f"max_turns must be an int in 2..40, got {max_turns!r}")
    env, app = new_app(NAME, DESCRIPTION, **options)

    def size(what: str) -> int:
        return env.size(SIZES[what])

    @app.tool(predict_time=T_LIST, kind="file")
    async def list_files() -> list[str]:
        """List the files of the project."""
        async with env.pace("list_files", T_LIST):
            return env.current().sandbox.files()

    @app.tool(predict_time=T_READ, kind="file")
    async def read_file(path: str) -> str:
        """Read a file of the project.

        Args:
            path: relative path, e.g. textutils.py.
        """
        async with env.pace("read_file", T_READ):
            try:
                return env.current().sandbox.read(path, max_chars=6000)
            except SandboxError as exc:
                raise tc.ToolError(str(exc), tool="read_file") from None

    @app.tool(predict_time=T_WRITE, kind="file")
    async def write_file(path: str, content: str) -> str:
        """Replace a file of the project with new content.

        Args:
            path: relative path, e.g. textutils.py.
            content: the complete new file content.
        """
        async with env.pace("write_file", T_WRITE):
            try:
                written = env.current().sandbox.write(path, content)
            except SandboxError as exc:
                raise tc.ToolError(str(exc), tool="write_file") from None
            return f"wrote {written['bytes']} bytes to {written['path']}"

    @app.tool(predict_time=T_TEST, kind="test", timeout=max(60.0, 2 * test_timeout))
    async def run_tests() -> dict[str, Any]:
        """Run the project's tests and report passes and failures."""
        async with env.pace("run_tests", T_TEST):
            report = await env.current().sandbox.run_tests(timeout=test_timeout)
            log = runner_log(report.to_dict(), size("log"), env.seed, "tool-agent")
            return {"ok": report.ok, "summary": report.summary(), "problems": report.problems(), "log": log}

    @app.tool(predict_time=T_SEARCH, kind="search")
    async def search_docs(query: str) -> list[dict[str, Any]]:
        """Search the offline programming notes.

        Args:
            query: keywords.
        """
        async with env.pace("search_docs", T_SEARCH):
            hits = []
            for h in env.corpus.search(query, 3):
                doc = env.corpus.get(h.id)
                page = document_text(doc.id, doc.title, doc.topic, doc.text, size("excerpt"), env.seed)
                hits.append({**h.to_dict(), "text": page})
            return hits

    async def setup(ctx: tc.Context, inputs: dict[str, Any]) -> dict[str, Any]:
        sandbox = env.current().sandbox
        for path, text in SEED_FILES.items():
            sandbox.write(path, text)
        readme = prose(rng_for("readme", env.seed), size("readme"), "python")
        sandbox.write(
            "README.md", "# textutils\n\nSmall text helpers used by the reporting jobs.\n\n" + readme + "\n"
        )
        return {"sandbox": str(sandbox.root), "files": sandbox.files()}

    app.add_function(env.node(setup), name="setup", description="seed the sandbox with the buggy project")

    async def swe_agent(ctx: tc.Context, inputs: dict[str, Any]) -> dict[str, Any]:
        prompt = f"Task: {ctx.inputs['task']}\n\nProject files: {', '.join(inputs['setup']['files'])}"
        try:
            reply = await ctx.llm(prompt, tools=TOOLS, max_turns=max_turns)
            return {"mode": "tools", "answer": reply.text.strip(), "turns": reply.turns, "stopped": None}
        except openai.BadRequestError as exc:
            turns = sum(1 for m in ctx.messages if m.get("role") == "assistant")
            if turns == 0 and "tool" in str(exc).lower():  # the server cannot parse tool calls
                return await _text_loop(ctx, prompt, max_turns)
            # e.g. the conversation outgrew the context: a result to report, not a crash
            return {"mode": "tools", "answer": "", "turns": turns, "stopped": f"server refused: {exc}"[:500]}
        except tc.ToolError as exc:  # still calling tools on the last allowed turn
            return {"mode": "tools", "answer": "", "turns": max_turns, "stopped": str(exc)}

    app.add_agent(
        env.node(swe_agent),
        name="swe_agent",
        system="You are a software engineer. Use the tools to inspect the project, run the tests, fix the "
        "code, and run the tests again. Finish with a one-sentence summary.",
        max_tokens=env.tokens(256),
        **env.tool_sampling,
        after=["setup"],
        tools=TOOLS,
        agent_type="swe_agent",
        # About six tool turns of ~150 output tokens each (the SWE traces' typical length).
        predict_llm_s=6 * 150 * 0.02,
    )

    async def verify(ctx: tc.Context, inputs: dict[str, Any]) -> dict[str, Any]:
        report = await ctx.call("run_tests")
        agent = inputs["swe_agent"]
        return {
            "fixed": report["ok"],
            "tests": report["summary"],
            "problems": report["problems"],
            "answer": agent["answer"],
            "turns": agent["turns"],
            "mode": agent["mode"],
            "stopped": agent["stopped"],
            "sandbox": str(env.current().sandbox.root),
        }

    app.add_function(env.node(verify), name="verify", after=["swe_agent"], calls=["run_tests"])
    return app


async def _text_loop(ctx: tc.Context, task_prompt: str, max_turns: int) -> dict[str, Any]:
    """The same tools through ``CALL name {json}`` lines, for servers without tool-call parsing."""
    prompt = task_prompt
    text = ""
    for turn in range(1, max_turns + 1):
        try:
            reply = await ctx.llm(prompt, system=_TEXT_PROTOCOL, tools=[], new_session=turn == 1)
        except openai.BadRequestError as exc:  # e.g. the conversation outgrew the context
            return {
                "mode": "text",
                "answer": text,
                "turns": turn - 1,
                "stopped": f"server refused: {exc}"[:500],
            }
        text = reply.text.strip()
        match = _CALL.search(text)
        if match is None or text.upper().startswith("DONE"):
            return {"mode": "text", "answer": text, "turns": turn, "stopped": None}
        name, raw = match.group(1), match.group(2) or "{}"
        if name not in TOOLS:
            prompt = f"error: unknown tool {name!r}; tools: {', '.join(TOOLS)}"
            continue
        try:
            args = json.loads(raw)
            if not isinstance(args, dict):
                raise ValueError("arguments must be a JSON object")
            result = await ctx.call(name, **args)
            prompt = clip(result if isinstance(result, str) else json.dumps(result), 1500)
        except (ValueError, tc.ToolError) as exc:  # bad JSON, bad arguments, tool failure
            prompt = f"error: {exc}"
    return {"mode": "text", "answer": text, "turns": max_turns, "stopped": "max_turns reached"}


_FIXED = SEED_FILES["textutils.py"].replace('text.split(" ")', "text.split()")


def script(request: tc.ScriptedRequest) -> tc.ToolCall | str:
    """A deterministic engineer: look around, reproduce, fix, re-test, summarise."""
    if request.body.get("tool_choice") == "none" or not request.tools:
        return "Fixed word_count in textutils.py: it now splits on any whitespace, and all tests pass."
    step = sum(1 for m in request.messages if m.get("role") == "tool")
    plan: list[tuple[str, dict[str, Any]]] = [
        ("list_files", {}),
        ("read_file", {"path": "README.md"}),
        ("read_file", {"path": "textutils.py"}),
        ("run_tests", {}),
        ("search_docs", {"query": "python split whitespace words"}),
        ("write_file", {"path": "textutils.py", "content": _FIXED}),
        ("run_tests", {}),
    ]
    if step < len(plan):
        name, args = plan[step]
        return tc.ToolCall(id=f"call_{step + 1}", name=name, arguments=args)
    return "Fixed word_count in textutils.py: it now splits on any whitespace, and all tests pass."


def final_answer(output: dict[str, Any]) -> str:
    """Whether the tests pass now, and what the agent said."""
    state = "fixed" if output.get("fixed") else "NOT fixed"
    how = f"{output.get('tests')}, {output.get('turns')} turns, {output.get('mode')} mode"
    return f"{state} ({how}): {output.get('answer', '')}"


__all__ = [
    "DEFAULT_INPUTS",
    "DEFAULT_TASK",
    "DESCRIPTION",
    "NAME",
    "SEED_FILES",
    "SHAPE",
    "build",
    "final_answer",
    "script",
]
