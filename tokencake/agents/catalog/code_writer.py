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

import ast
import json
import re
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

import tokencake as tc
from tokencake.agents.catalog._corpus import query_terms
from tokencake.agents.catalog._env import EnvOptions, new_app
from tokencake.agents.catalog._material import document_text, prose, python_module, rng_for, runner_log
from tokencake.agents.catalog._sandbox import SandboxError
from tokencake.agents.catalog._text import (
    clip,
    extract_files,
    format_files,
    numbered_lines,
    one_line,
    python_paths,
)

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
PROGRAMMERS = 3
REVISERS = 2

#: Published tool times (seconds) of the evaluation DAG.
T_SEARCH, T_CHECK, T_WRITE = 4.0, 0.4, 0.1
T_VALIDATE, T_REVALIDATE = 8.0, 10.0
T_EXTERNAL, T_CONFIRM, T_TEST = 4.5, 3.5, 5.5
SEARCH_STAGES = {"query": 0.5, "execute": 1.0, "results": 0.5}

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
_CODE_CHARS = 3.2
TEST_STAGES = {"style": 0.5, "compile": 1.0, "functional": 2.0, "report": 1.0}

_FILE_FORMAT = (
    "Write each file as a line `# file: PATH` followed by a ```python fenced block with the whole file. "
    "Tests are plain functions named test_* using assert (no pytest imports)."
)
_SYSTEMS = {
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


def _part_paths(plan_text: str) -> list[dict[str, str]]:
    """Module and test paths of the three parts of the file plan (fallbacks when unparseable)."""
    modules: list[str] = []
    for line in numbered_lines(plan_text, 20):
        for path in python_paths(line):
            name = PurePosixPath(path).name
            if not name.startswith("test_") and path not in modules and _valid_module(path):
                modules.append(path)
                break
    for k in range(len(modules) + 1, PROGRAMMERS + 1):
        modules.append(f"part_{k}.py")
    parts = []
    for k, module in enumerate(modules[:PROGRAMMERS], 1):
        pure = PurePosixPath(module)
        test = str(pure.with_name(f"test_{pure.name}"))
        parts.append({"index": str(k), "module": module, "test": test})
    return parts


def _user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


def _new_first(files: dict[str, str]) -> dict[str, str]:
    """The files the programmers wrote first, then the existing project (which a cap may cut)."""
    return dict(sorted(files.items(), key=lambda item: (item[0] in PROJECT_MODULES, item[0])))


def _valid_module(path: str) -> bool:
    pure = PurePosixPath(path)
    return (
        not pure.is_absolute()
        and ".." not in pure.parts
        and all(p.isidentifier() for p in pure.with_suffix("").parts)
    )


def _verdict(text: str) -> bool:
    low = (text or "").lower()
    approve = re.search(r"\b(approve[sd]?|accept(ed)?|lgtm)\b", low)
    reject = re.search(r"\b(revise|reject(ed)?|not approve[sd]?)\b", low)
    if approve and reject:
        return approve.start() < reject.start()
    return bool(approve)


def build(
    *,
    test_timeout: float = 30.0,
    **options: Unpack[EnvOptions],
) -> tc.App:
    """The code-writer app (see the module docstring); ``test_timeout`` bounds each test subprocess."""
    env, app = new_app(NAME, DESCRIPTION, **options)

    def size(what: str) -> int:
        return env.size(SIZES[what])

    # ------------------------------------------------------------------ tools

    @app.tool(predict_time=T_SEARCH, kind="search", stages=SEARCH_STAGES, timeout=60.0)
    async def web_search(query: str, k: int = 3) -> list[dict[str, Any]]:
        """Search the offline reference corpus (BM25 full-text ranking).

        Args:
            query: keywords to look for.
            k: number of results.
        """
        async with env.pace("web_search", T_SEARCH):
            hits = []
            for h in env.corpus.search(query, k):
                doc = env.corpus.get(h.id)
                page = document_text(doc.id, doc.title, doc.topic, doc.text, size("excerpt"), env.seed)
                hits.append({**h.to_dict(), "text": page})
            return hits

    @app.tool(predict_time=T_CHECK, kind="check")
    async def conditional_check(verdict: str, design: str) -> dict[str, Any]:
        """Decide whether a judgement approves a design, and which files the design names.

        Args:
            verdict: the judge's answer.
            design: the design under judgement.
        """
        async with env.pace("conditional_check", T_CHECK):
            files = python_paths(design)
            approved = _verdict(verdict)
            return {
                "approved": approved,
                "reason": one_line(verdict) or "empty verdict",
                "design_files": files,
            }

    @app.tool(predict_time=T_WRITE, kind="file")
    async def write_files(files: dict[str, str], guard: bool = False) -> dict[str, Any]:
        """Write files into the sandbox.

        Args:
            files: path -> full file content.
            guard: only write if the test suite does not get worse with the new files.
        """
        async with env.pace("write_files", T_WRITE):
            sandbox = env.current().sandbox
            if guard and files:
                before = await sandbox.run_tests(timeout=test_timeout)
                staged = sandbox.stage(files)
                try:
                    after = await staged.run_tests(timeout=test_timeout)
                finally:
                    staged.remove()
                regress = (
                    len(after.passed) < len(before.passed)
                    or len(after.failed) + len(after.errors) > len(before.failed) + len(before.errors)
                    or len(after.compile_errors) > len(before.compile_errors)
                    or (before.ok and not after.ok)
                )
                if regress:
                    return {
                        "written": [],
                        "skipped": sorted(files),
                        "reason": f"would regress: {after.summary()}",
                    }
            written, skipped, errors = [], [], []
            for path, text in files.items():
                try:
                    written.append(sandbox.write(path, text)["path"])
                except SandboxError as exc:  # a model-chosen path we refuse: report, keep going
                    skipped.append(path)
                    errors.append(str(exc))
            return {"written": written, "skipped": skipped, "reason": "; ".join(errors) or "ok"}

    async def _validate(files: dict[str, str], tests: list[str] | None) -> dict[str, Any]:
        sandbox = env.current().sandbox
        if not files:
            report = await sandbox.run_tests(timeout=test_timeout)
        else:
            try:
                staged = sandbox.stage(files)
            except SandboxError as exc:
                return {"ok": False, "summary": f"patch rejected: {exc}", "problems": [str(exc)], "passed": 0}
            try:
                report = await staged.run_tests(tests, timeout=test_timeout)
            finally:
                staged.remove()
        return {
            "ok": report.ok,
            "summary": report.summary(),
            "problems": report.problems(),
            "passed": len(report.passed),
            "failed": len(report.failed) + len(report.errors),
            "timed_out": report.timed_out,
            # The whole test output, as a runner prints it: what the agent reads next.
            "log": runner_log(report.to_dict(), size("log"), env.seed, "|".join(sorted(files))),
        }

    @app.tool(predict_time=T_VALIDATE, kind="validate")
    async def validate_patch(files: dict[str, str], tests: list[str] | None = None) -> dict[str, Any]:
        """Apply a patch to a scratch copy of the sandbox, compile it and run its tests.

        Args:
            files: path -> full new content.
            tests: test files to run (default: every test_*.py).
        """
        async with env.pace("validate_patch", T_VALIDATE):
            return await _validate(files, [t for t in tests or [] if t in files] or None)

    @app.tool(predict_time=T_REVALIDATE, kind="validate")
    async def validate_revision(files: dict[str, str]) -> dict[str, Any]:
        """Apply a revision to a scratch copy of the sandbox and run the whole test suite.

        Args:
            files: path -> full new content (empty: validate the current tree).
        """
        async with env.pace("validate_revision", T_REVALIDATE):
            return await _validate(files, None)

    @app.tool(predict_time=T_EXTERNAL, kind="eval")
    async def external_evaluation(focus: str = "") -> dict[str, Any]:
        """Static evaluation of the sandbox: syntax, functions, docstrings, tests, long lines.

        Args:
            focus: what the evaluator was asked to look at (recorded with the result).
        """
        async with env.pace("external_evaluation", T_EXTERNAL):
            sandbox = env.current().sandbox
            py = [f for f in sandbox.files() if f.endswith(".py")]
            functions = documented = tests = long_lines = 0
            for rel in py:
                source = sandbox.read(rel, max_chars=1_000_000)
                long_lines += sum(1 for line in source.splitlines() if len(line) > 100)
                try:
                    tree = ast.parse(source)
                except SyntaxError:
                    continue
                for node in ast.walk(tree):
                    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                        if node.name.startswith("test"):
                            tests += 1
                        else:
                            functions += 1
                            documented += ast.get_docstring(node) is not None
            errors = sandbox.compile_errors(py)
            parts = [
                functions > 0,
                tests > 0,
                not errors,
                functions == 0 or documented / functions >= 0.5,
                long_lines == 0,
            ]
            return {
                "focus": clip(focus, 300),
                "python_files": len(py),
                "functions": functions,
                "documented": documented,
                "tests": tests,
                "compile_errors": errors,
                "long_lines": long_lines,
                "score": round(sum(parts) / len(parts), 2),
            }

    @app.tool(predict_time=T_CONFIRM, kind="human")
    async def confirm_with_user(summary: str) -> dict[str, Any]:
        """A simulated user reads the summary and approves when it is informative and the code compiles.

        Args:
            summary: what changed, for the user.
        """
        async with env.pace("confirm_with_user", T_CONFIRM):
            sandbox = env.current().sandbox
            errors = sandbox.compile_errors()
            words = len(summary.split())
            approved = words >= 5 and not errors
            if errors:
                comment = f"rejected: {len(errors)} files do not compile"
            elif words < 5:
                comment = "rejected: the summary says too little"
            else:
                comment = "approved"
            return {"approved": approved, "comment": comment}

    @app.tool(predict_time=T_TEST, kind="test", stages=TEST_STAGES, timeout=max(60.0, test_timeout * 2))
    async def run_tests(plan: str = "") -> dict[str, Any]:
        """Final test stage: style check, compile check, functional tests, report file.

        Args:
            plan: the tester's plan (recorded in the report).
        """
        async with env.pace("run_tests", T_TEST):
            sandbox = env.current().sandbox
            style = []
            for rel in sandbox.files():
                if rel.endswith(".py"):
                    for n, line in enumerate(sandbox.read(rel, max_chars=1_000_000).splitlines(), 1):
                        if len(line) > 100 or "\t" in line or line != line.rstrip():
                            style.append(f"{rel}:{n}")
            report = await sandbox.run_tests(timeout=test_timeout)
            result = {
                "ok": report.ok,
                "summary": report.summary(),
                "passed": report.passed,
                "failed": [f["test"] for f in report.failed + report.errors],
                "problems": report.problems(10),
                "compile_errors": report.compile_errors,
                "style_issues": style[:50],
                "timed_out": report.timed_out,
                "plan": clip(plan, 300),
            }
            sandbox.write("TEST_REPORT.json", json.dumps(result, indent=2) + "\n")
            return result

    # ------------------------------------------------------------------ nodes

    def agent(
        name: str, fn: Any, role: str, max_tokens: int, after: list[str], calls: list[str] = ()
    ) -> None:
        app.add_agent(
            env.node(fn),
            name=name,
            system=_SYSTEMS[role],
            max_tokens=env.tokens(max_tokens),
            **env.sampling,
            after=after,
            calls=list(calls),
            agent_type=role,
            description=f"{role} ({max_tokens} output tokens)",
        )

    async def start(ctx: tc.Context, inputs: dict[str, Any]) -> dict[str, Any]:
        task = str(ctx.inputs["task"])
        sandbox = env.current().sandbox
        sandbox.write("TASK.md", f"# Task\n\n{task}\n")
        # The existing project the programmers work in: a style guide and modules to build on.
        rules = prose(rng_for("style", env.seed), size("style"), "python")
        sandbox.write("CONTRIBUTING.md", "# Contributing\n\n" + rules + "\n")
        for path in PROJECT_MODULES:
            sandbox.write(path, python_module(path, size("module"), env.seed))
        return {"task": task, "sandbox": str(sandbox.root)}

    app.add_function(
        env.node(start), name="start", description="create the run's sandbox and record the task"
    )

    for r in (1, 2):

        async def architect(ctx: tc.Context, inputs: dict[str, Any], r: int = r) -> dict[str, Any]:
            task = str(ctx.inputs["task"])
            if r == 1:
                prompt = (
                    f"Task: {task}\n\n"
                    "Design the solution: name three Python modules (file names) and what each does."
                )
            else:
                prev = inputs[f"judger_{r - 1}"]
                prompt = (
                    f"Task: {task}\n\nPrevious design:\n{clip(prev['design'], 1200)}\n\n"
                    f"Judgement: {'approved' if prev['approved'] else 'revise'} — {prev['reason']}\n"
                    f"Background found: {', '.join(prev['sources']) or 'none'}\n\n"
                    "Write the final design: three Python modules (file names) and what each does."
                )
            reply = await ctx.llm(prompt)
            return {"design": reply.text.strip() or task}

        async def search(ctx: tc.Context, inputs: dict[str, Any], r: int = r) -> dict[str, Any]:
            design = inputs[f"architect_{r}"]["design"]
            reply = await ctx.llm(
                f"Design:\n{clip(design, 1500)}\n\nWrite one keyword search query for background."
            )
            query = one_line(reply.text)
            if not query_terms(query):
                query = str(ctx.inputs["task"])
            hits = await ctx.call("web_search", query=query, k=3)
            return {"design": design, "query": query, "hits": hits}

        async def judger(ctx: tc.Context, inputs: dict[str, Any], r: int = r) -> dict[str, Any]:
            found = inputs[f"search_{r}"]
            background = (
                "\n\n".join(
                    f"[{h['id']}] {h['title']}\n{h.get('text') or h['snippet']}" for h in found["hits"]
                )
                or "- none"
            )
            reply = await ctx.llm(
                f"Task: {ctx.inputs['task']}\n\nDesign:\n{clip(found['design'], 1500)}\n\n"
                f"Background:\n{background}\n\nAPPROVE or REVISE?"
            )
            check = await ctx.call("conditional_check", verdict=reply.text, design=found["design"])
            return {
                "design": found["design"],
                "approved": check["approved"],
                "reason": check["reason"],
                "sources": [h["id"] for h in found["hits"]],
            }

        agent(f"architect_{r}", architect, "architect", 200, [f"judger_{r - 1}"] if r > 1 else ["start"])
        agent(f"search_{r}", search, "search", 128, [f"architect_{r}"], ["web_search"])
        agent(f"judger_{r}", judger, "judger", 128, [f"search_{r}"], ["conditional_check"])

    async def file_write_plan(ctx: tc.Context, inputs: dict[str, Any]) -> dict[str, Any]:
        final = inputs["judger_2"]
        reply = await ctx.llm(
            f"Task: {ctx.inputs['task']}\n\nDesign:\n{clip(final['design'], 1500)}\n\n"
            "Assign the work to three programmers: one module file each."
        )
        parts = _part_paths(reply.text)
        lines = [f"{p['index']}. {p['module']} (tests: {p['test']})" for p in parts]
        plan = "# Plan\n\n" + "\n".join(lines) + "\n\n## Design\n\n" + final["design"] + "\n"
        await ctx.call("write_files", files={"PLAN.md": plan})
        approvals = [inputs["judger_1"]["approved"], final["approved"]]
        return {"design": final["design"], "parts": parts, "approvals": approvals}

    agent("file_write_plan", file_write_plan, "planner", 128, ["judger_2", "judger_1"], ["write_files"])

    for k in range(1, PROGRAMMERS + 1):

        async def patch(ctx: tc.Context, inputs: dict[str, Any], k: int = k) -> dict[str, Any]:
            plan = inputs["file_write_plan"]
            part = plan["parts"][k - 1]
            others = ", ".join(p["module"] for p in plan["parts"] if p is not part)
            sandbox = env.current().sandbox
            existing = PROJECT_MODULES[(k - 1) % len(PROJECT_MODULES)]
            context = {existing: sandbox.read(existing)} if sandbox.exists(existing) else {}
            guide = sandbox.read("CONTRIBUTING.md") if sandbox.exists("CONTRIBUTING.md") else ""
            reply = await ctx.llm(
                f"Task: {ctx.inputs['task']}\n\nDesign:\n{clip(plan['design'], 1200)}\n\n"
                f"Project style guide:\n{guide}\n\n"
                f"Existing code you may reuse (do not change it):\n{format_files(context, 10**6, 10**6)}\n\n"
                f"You own `{part['module']}` and its tests `{part['test']}` (others write {others}; "
                "do not import their modules). Write both files."
            )
            allowed = [part["module"], part["test"]]
            files = extract_files(reply.text, allowed, default=part["module"])
            env.keep(ctx.node, ctx.messages)  # the repair continues this conversation
            result = await ctx.call("validate_patch", files=files, tests=[part["test"]])
            return {"part": part, "files": files, "validation": result}

        async def repair(ctx: tc.Context, inputs: dict[str, Any], k: int = k) -> dict[str, Any]:
            prev = inputs[f"programmer_{k}_validate_patch"]
            part, files, validation = prev["part"], prev["files"], prev["validation"]
            # Same agent, same conversation: the patch request and its reply, then the test output.
            history = env.history(f"programmer_{k}_validate_patch")
            log = validation.get("log", "")
            if validation["ok"]:
                reply = await ctx.llm(
                    [
                        *history,
                        _user(
                            f"Your patch passed validation ({validation['summary']}).\n\n"
                            f"Test output:\n{log}\n\nAny remaining risk?"
                        ),
                    ]
                )
                return {"part": part, "files": files, "validation": validation, "note": one_line(reply.text)}
            problems = "\n".join(f"- {p}" for p in validation["problems"]) or "- (no details)"
            current = "" if history else f"Current files:\n{format_files(files)}\n\n"
            reply = await ctx.llm(
                [
                    *history,
                    _user(
                        f"Validation failed: {validation['summary']}\n{problems}\n\nTest output:\n{log}\n\n"
                        f"{current}Fix them and write both files again."
                    ),
                ]
            )
            fixed = extract_files(reply.text, [part["module"], part["test"]])
            return {"part": part, "files": {**files, **fixed}, "validation": validation, "note": "repaired"}

        async def code_write(ctx: tc.Context, inputs: dict[str, Any], k: int = k) -> dict[str, Any]:
            prev = inputs[f"programmer_{k}_repair"]
            reply = await ctx.llm(f"Commit message for writing {', '.join(prev['files'])}:")
            written = await ctx.call("write_files", files=prev["files"])
            return {"part": prev["part"], "written": written["written"], "message": one_line(reply.text)}

        agent(
            f"programmer_{k}_validate_patch",
            patch,
            "programmer",
            400,
            ["file_write_plan"],
            ["validate_patch"],
        )
        agent(f"programmer_{k}_repair", repair, "programmer", 400, [f"programmer_{k}_validate_patch"])
        agent(f"code_write_{k}", code_write, "writer", 128, [f"programmer_{k}_repair"], ["write_files"])

    writers = [f"code_write_{k}" for k in range(1, PROGRAMMERS + 1)]
    focus = {1: "correctness of the implementation modules", 2: "quality and coverage of the tests"}

    for r in (1, 2):

        async def reviewer(ctx: tc.Context, inputs: dict[str, Any], r: int = r) -> dict[str, Any]:
            sandbox = env.current().sandbox
            code = _new_first(sandbox.snapshot((".py",)))
            listing = format_files(code, 2400, int(size("review_code") * _CODE_CHARS))
            reply = await ctx.llm(
                f"Task: {ctx.inputs['task']}\n\nReview for {focus[r]}:\n\n{listing}\n\n"
                "List concrete problems, or say it looks good."
            )
            return {"focus": focus[r], "review": reply.text.strip(), "files": sorted(code)}

        agent(f"reviewer_{r}", reviewer, "reviewer", 200, writers)

    for r in range(1, REVISERS + 1):

        async def revise(ctx: tc.Context, inputs: dict[str, Any], r: int = r) -> dict[str, Any]:
            review = inputs[f"reviewer_{r}"]
            sandbox = env.current().sandbox
            code = _new_first(sandbox.snapshot((".py",)))
            listing = format_files(code, 1200, int(size("revise_code") * _CODE_CHARS))
            reply = await ctx.llm(
                f"Review ({review['focus']}):\n{clip(review['review'], 1200)}\n\n"
                f"Code:\n{listing}\n\n"
                "Write revised versions of the files that need changes."
            )
            writable = sorted(p for p in code if p not in PROJECT_MODULES)
            files = extract_files(reply.text, writable) if "NO CHANGES" not in reply.text.upper() else {}
            env.keep(ctx.node, ctx.messages)  # the repair continues this conversation
            result = await ctx.call("validate_revision", files=files)
            return {"files": files, "validation": result}

        async def revise_repair(ctx: tc.Context, inputs: dict[str, Any], r: int = r) -> dict[str, Any]:
            prev = inputs[f"reviser_{r}_validate_patch"]
            files, validation = prev["files"], prev["validation"]
            history = env.history(f"reviser_{r}_validate_patch")
            log = validation.get("log", "")
            if validation["ok"] or not files:
                reply = await ctx.llm(
                    [
                        *history,
                        _user(
                            f"Revision check: {validation['summary']}.\n\nTest output:\n{log}\n\n"
                            "Anything else to change?"
                        ),
                    ]
                )
                return {"files": files, "validation": validation, "note": one_line(reply.text)}
            problems = "\n".join(f"- {p}" for p in validation["problems"]) or "- (no details)"
            current = "" if history else f"{format_files(files)}\n\n"
            reply = await ctx.llm(
                [
                    *history,
                    _user(
                        f"The revision failed: {validation['summary']}\n{problems}\n\nTest output:\n{log}\n\n"
                        f"{current}Fix the revised files."
                    ),
                ]
            )
            fixed = extract_files(reply.text, sorted(files))
            return {"files": {**files, **fixed}, "validation": validation, "note": "repaired"}

        async def revised_write(ctx: tc.Context, inputs: dict[str, Any], r: int = r) -> dict[str, Any]:
            prev = inputs[f"reviser_{r}_repair"]
            reply = await ctx.llm(
                f"Commit message for the revision of {', '.join(prev['files']) or 'nothing'}:"
            )
            # Guarded: a revision is applied only if it does not make the test suite worse.
            written = await ctx.call("write_files", files=prev["files"], guard=True)
            return {**written, "message": one_line(reply.text)}

        agent(f"reviser_{r}_validate_patch", revise, "reviser", 400, [f"reviewer_{r}"], ["validate_revision"])
        agent(f"reviser_{r}_repair", revise_repair, "reviser", 400, [f"reviser_{r}_validate_patch"])
        agent(
            f"revised_code_write_{r}", revised_write, "writer", 128, [f"reviser_{r}_repair"], ["write_files"]
        )

    async def external(ctx: tc.Context, inputs: dict[str, Any]) -> dict[str, Any]:
        reviews = "\n".join(
            f"- {inputs[f'reviewer_{r}']['focus']}: {clip(inputs[f'reviewer_{r}']['review'], 300)}"
            for r in (1, 2)
        )
        reply = await ctx.llm(f"Reviews:\n{reviews}\n\nWhat should an external evaluation check?")
        return await ctx.call("external_evaluation", focus=reply.text.strip())

    agent("external_eval", external, "evaluator", 128, ["reviewer_2", "reviewer_1"], ["external_evaluation"])

    async def confirm(ctx: tc.Context, inputs: dict[str, Any]) -> dict[str, Any]:
        evaluation = inputs["external_eval"]
        revised = [p for r in range(1, REVISERS + 1) for p in inputs[f"revised_code_write_{r}"]["written"]]
        reply = await ctx.llm(
            f"Task: {ctx.inputs['task']}\n\nFiles: {', '.join(env.current().sandbox.files())}\n"
            f"Revised: {', '.join(revised) or 'none'}\nEvaluation score: {evaluation['score']} "
            f"({evaluation['functions']} functions, {evaluation['tests']} tests)\n\n"
            "Summarise the change for the user."
        )
        decision = await ctx.call("confirm_with_user", summary=reply.text.strip())
        return {**decision, "summary": reply.text.strip(), "evaluation": evaluation}

    agent(
        "user_confirm",
        confirm,
        "confirm",
        128,
        ["revised_code_write_1", "revised_code_write_2", "external_eval"],
        ["confirm_with_user"],
    )

    async def test_node(ctx: tc.Context, inputs: dict[str, Any]) -> dict[str, Any]:
        confirmed = inputs["user_confirm"]
        reply = await ctx.llm(f"Files: {', '.join(env.current().sandbox.files())}\nPlan the final test run.")
        report = await ctx.call("run_tests", plan=reply.text.strip())
        return {"tests": report, "confirmation": confirmed}

    agent("test_node", test_node, "tester", 128, ["user_confirm"], ["run_tests"])

    async def end(ctx: tc.Context, inputs: dict[str, Any]) -> dict[str, Any]:
        final = inputs["test_node"]
        sandbox = env.current().sandbox
        tests = final["tests"]
        confirmation = final["confirmation"]
        return {
            "task": str(ctx.inputs["task"]),
            "sandbox": str(sandbox.root),
            "files": sandbox.files(),
            "tests_passed": tests["ok"],
            "tests": {k: tests[k] for k in ("summary", "passed", "failed", "problems", "style_issues")},
            "approved": confirmation["approved"],
            "summary": confirmation["summary"],
            "evaluation": confirmation["evaluation"],
        }

    app.add_function(env.node(end), name="end", after=["test_node"], description="collect the artifacts")
    return app


# ---------------------------------------------------------------------- scripted model

_SOLUTION = {
    1: (
        "ranges_parse.py",
        '''"""Parse range lists such as '1-3, 7'."""


def parse_ranges(text):
    """Return sorted (start, end) tuples; raise ValueError on bad items."""
    ranges = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        start, sep, end = item.partition("-")
        try:
            lo = int(start)
            hi = int(end) if sep else lo
        except ValueError:
            raise ValueError(f"bad range {item!r}") from None
        if hi < lo:
            raise ValueError(f"range {item!r} ends before it starts")
        ranges.append((lo, hi))
    return sorted(ranges)
''',
        """from ranges_parse import parse_ranges


def test_single_and_pairs():
    assert parse_ranges("5, 1-3") == [(1, 3), (5, 5)]


def test_blank_items_are_ignored():
    assert parse_ranges(" 2-4 ,, ") == [(2, 4)]


def test_bad_item_raises():
    for text in ["x-2", "5-1"]:
        try:
            parse_ranges(text)
        except ValueError:
            continue
        assert False, f"expected ValueError for {text!r}"
""",
    ),
    2: (
        "ranges_merge.py",
        '''"""Merge overlapping ranges and measure coverage."""


def merge_ranges(ranges):
    """Merge overlapping or touching (start, end) ranges; returns a sorted list."""
    merged = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def coverage(ranges):
    """Number of integers covered by the ranges, overlaps counted once."""
    return sum(hi - lo + 1 for lo, hi in merge_ranges(ranges))
''',
        """from ranges_merge import coverage, merge_ranges


def test_merge_overlapping_and_touching():
    assert merge_ranges([(9, 9), (1, 3), (7, 8), (2, 4)]) == [(1, 4), (7, 9)]


def test_merge_empty():
    assert merge_ranges([]) == []


def test_coverage_counts_overlaps_once():
    assert coverage([(1, 3), (2, 4), (7, 9)]) == 7
""",
    ),
    3: (
        "ranges_report.py",
        '''"""Format ranges as a short coverage report."""


def format_ranges(ranges):
    """'1-3, 5' style text for (start, end) tuples."""
    return ", ".join(f"{lo}-{hi}" if hi > lo else str(lo) for lo, hi in ranges)


def format_report(ranges, total):
    """One line: the ranges and the share of `total` they cover."""
    covered = sum(hi - lo + 1 for lo, hi in ranges)
    share = covered / total if total else 0.0
    return f"{format_ranges(ranges)} covers {covered} of {total} ({share:.0%})"
''',
        """from ranges_report import format_ranges, format_report


def test_format_ranges():
    assert format_ranges([(1, 3), (5, 5)]) == "1-3, 5"


def test_format_report():
    assert format_report([(1, 3), (5, 5)], 8) == "1-3, 5 covers 4 of 8 (50%)"


def test_zero_total():
    assert format_report([], 0) == " covers 0 of 0 (0%)"
""",
    ),
}

_REVISION = (
    "ranges_report.py",
    '''"""Format ranges as a short coverage report."""


def format_ranges(ranges):
    """'1-3, 5' style text for (start, end) tuples."""
    return ", ".join(f"{lo}-{hi}" if hi > lo else str(lo) for lo, hi in ranges)


def format_report(ranges, total):
    """One line: the ranges and the share of `total` they cover."""
    if total < 0:
        raise ValueError("total must not be negative")
    covered = sum(hi - lo + 1 for lo, hi in ranges)
    share = covered / total if total else 0.0
    return f"{format_ranges(ranges)} covers {covered} of {total} ({share:.0%})"
''',
    "test_ranges_report.py",
    """from ranges_report import format_ranges, format_report


def test_format_ranges():
    assert format_ranges([(1, 3), (5, 5)]) == "1-3, 5"


def test_format_report():
    assert format_report([(1, 3), (5, 5)], 8) == "1-3, 5 covers 4 of 8 (50%)"


def test_zero_total():
    assert format_report([], 0) == " covers 0 of 0 (0%)"


def test_negative_total_raises():
    try:
        format_report([(1, 2)], -1)
    except ValueError:
        return
    assert False, "expected ValueError"
""",
)

_DESIGN = (
    "1. ranges_parse.py: parse_ranges(text) turns '1-3, 5' into sorted (start, end) tuples.\n"
    "2. ranges_merge.py: merge_ranges(ranges) merges overlaps; coverage(ranges) counts integers.\n"
    "3. ranges_report.py: format_report(ranges, total) writes a one-line coverage report.\n"
    "Each module is standalone and has a test_ module with plain asserts."
)


def _files_reply(*pairs: str) -> str:
    return "\n\n".join(
        f"# file: {path}\n```python\n{code}```" for path, code in zip(pairs[::2], pairs[1::2], strict=True)
    )


def _solution_reply(k: int) -> str:
    module, code, tests = _SOLUTION[k]
    return _files_reply(module, code, f"test_{module}", tests)


def script(request: tc.ScriptedRequest) -> str:
    """Deterministic replies that solve :data:`DEFAULT_TASK` (used by ``--scripted`` and the tests)."""
    node = request.node
    if node.startswith("architect_"):
        return _DESIGN
    if node.startswith("search_"):
        return "merge overlapping intervals parse ranges python testing"
    if node.startswith("judger_"):
        return "APPROVE: the design separates parsing, merging and reporting, and every module has tests."
    if node == "file_write_plan":
        return "\n".join(
            line.split(":")[0] + ": " + line.split(":", 1)[1].strip() for line in _DESIGN.splitlines()[:3]
        )
    match = re.fullmatch(r"programmer_(\d)_(validate_patch|repair)", node)
    if match:
        k = int(match.group(1))
        if match.group(2) == "repair" and "passed validation" in request.prompt:
            return "No remaining risk: the tests cover normal input, blanks and errors."
        return _solution_reply(k)
    if node.startswith("code_write_"):
        return f"Add the module and tests of part {node.rsplit('_', 1)[1]}."
    if node == "reviewer_1":
        return (
            "format_report accepts a negative total and prints a negative share; it should raise ValueError."
        )
    if node == "reviewer_2":
        return "Tests cover normal input, blank items, errors and empty input. Looks good."
    if node == "reviser_1_validate_patch":
        return _files_reply(*_REVISION)
    if node.startswith("reviser_"):
        return "NO CHANGES" if node == "reviser_2_validate_patch" else "Nothing else to change."
    if node.startswith("revised_code_write_"):
        return "Reject negative totals in format_report." if node.endswith("1") else "No revision needed."
    if node == "external_eval":
        return "Check that every module compiles, has docstrings and is covered by tests."
    if node == "user_confirm":
        return (
            "Added ranges_parse, ranges_merge and ranges_report with tests; format_report now rejects "
            "negative totals. All validations passed."
        )
    if node == "test_node":
        return "Run every test_*.py after the style and compile checks."
    return "OK"


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
