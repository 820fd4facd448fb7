"""code-writer's tools: search, verdict check, file writes, patch and revision validation, static
evaluation, a simulated user and the final test stage, all working in the run's sandbox."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

import tokencake as tc
from tokencake.agents.catalog._env import AppEnv
from tokencake.agents.catalog._material import document_text, runner_log
from tokencake.agents.catalog._sandbox import SandboxError
from tokencake.agents.catalog._text import clip, one_line, python_paths
from tokencake.agents.catalog.code_writer._prompts import size

#: Published tool times (seconds) of the evaluation DAG.
T_SEARCH, T_CHECK, T_WRITE = 4.0, 0.4, 0.1
T_VALIDATE, T_REVALIDATE = 8.0, 10.0
T_EXTERNAL, T_CONFIRM, T_TEST = 4.5, 3.5, 5.5
SEARCH_STAGES = {"query": 0.5, "execute": 1.0, "results": 0.5}
TEST_STAGES = {"style": 0.5, "compile": 1.0, "functional": 2.0, "report": 1.0}


def _verdict(text: str) -> bool:
    low = (text or "").lower()
    approve = re.search(r"\b(approve[sd]?|accept(ed)?|lgtm)\b", low)
    reject = re.search(r"\b(revise|reject(ed)?|not approve[sd]?)\b", low)
    if approve and reject:
        return approve.start() < reject.start()
    return bool(approve)


def add_tools(app: tc.App, env: AppEnv, *, test_timeout: float) -> None:
    """Declare the tools on ``app``; ``test_timeout`` bounds each test subprocess."""

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
                page = document_text(doc.id, doc.title, doc.topic, doc.text, size(env, "excerpt"), env.seed)
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
            "log": runner_log(report.to_dict(), size(env, "log"), env.seed, "|".join(sorted(files))),
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
