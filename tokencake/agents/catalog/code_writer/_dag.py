"""code-writer's DAG: the agents and functions (see the package docstring for the shape) and the
rules they apply to the model's replies (the file plan, which files to show first)."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

import tokencake as tc
from tokencake.agents.catalog._corpus import query_terms
from tokencake.agents.catalog._env import AppEnv
from tokencake.agents.catalog._material import prose, python_module, rng_for
from tokencake.agents.catalog._text import (
    clip,
    extract_files,
    format_files,
    numbered_lines,
    one_line,
    python_paths,
)
from tokencake.agents.catalog.code_writer._prompts import CODE_CHARS, PROJECT_MODULES, SYSTEMS, size

PROGRAMMERS = 3
REVISERS = 2


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


def add_nodes(app: tc.App, env: AppEnv) -> None:
    """Declare the nodes on ``app`` (after its tools)."""

    def agent(
        name: str, fn: Any, role: str, max_tokens: int, after: list[str], calls: list[str] = ()
    ) -> None:
        app.add_agent(
            env.node(fn),
            name=name,
            system=SYSTEMS[role],
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
        rules = prose(rng_for("style", env.seed), size(env, "style"), "python")
        sandbox.write("CONTRIBUTING.md", "# Contributing\n\n" + rules + "\n")
        for path in PROJECT_MODULES:
            sandbox.write(path, python_module(path, size(env, "module"), env.seed))
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
            listing = format_files(code, 2400, int(size(env, "review_code") * CODE_CHARS))
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
            listing = format_files(code, 1200, int(size(env, "revise_code") * CODE_CHARS))
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
