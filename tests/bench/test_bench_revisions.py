"""``NAME@REV`` systems: parsing, the revision's exported package, and what its server is started with."""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from tokencake.bench import presets, revisions, terminal
from tokencake.bench.markdown import markdown
from tokencake.bench.revisions import (
    TRANSPARENT_MODULE,
    SourceTree,
    export_tree,
    prepare_source,
    resolve_revision,
    split_name,
)
from tokencake.bench.runner import run_bench
from tokencake.bench.systems import SYSTEMS, ServerConfig, resolve_systems, server_kwargs
from tokencake.cli import main
from tokencake.serving import Server
from tokencake.serving.tool_calling import BUNDLED_PARSER, PARSER_PLUGIN

pytestmark = pytest.mark.filterwarnings("ignore:stall events are not reaching")

#: What the launcher gives a server of the bundled model (``tool_calling_args``).
BUNDLED_TOOL_ARGS = [
    *("--tool-parser-plugin", PARSER_PLUGIN, "--enable-auto-tool-choice"),
    *("--tool-call-parser", BUNDLED_PARSER, "--chat-template", "/t/smollm2_tools.jinja"),
]


def _git(repo: Path, *args: str) -> str:
    cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args]
    return subprocess.run(cmd, cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A checkout with two commits of a ``tokencake/`` package, taken as the running package's."""
    root = tmp_path / "checkout"
    (root / "tokencake" / "serving" / "vllm").mkdir(parents=True)
    _git(root, "init", "-q")
    (root / "tokencake" / "__init__.py").write_text("VERSION = 'old'\n")
    (root / "tokencake" / "serving" / "vllm" / "__init__.py").write_text("")
    (root / "README.md").write_text("not exported\n")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "old")
    _git(root, "tag", "old")
    (root / "tokencake" / "__init__.py").write_text("VERSION = 'new'\n")
    _git(root, "commit", "-q", "-am", "new")
    (root / "tokencake" / "__init__.py").write_text("VERSION = 'uncommitted'\n")
    monkeypatch.setattr(revisions, "package_checkout", lambda: root)
    monkeypatch.setattr(revisions, "launcher_tool_args", lambda server: list(BUNDLED_TOOL_ARGS))
    return root


def test_names_split_at_the_first_at_sign():
    assert split_name("tokencake@945f1b2") == ("tokencake", "945f1b2")
    assert split_name("tokencake@v1@x") == ("tokencake", "v1@x")
    assert split_name("baseline") == ("baseline", None)
    with pytest.raises(ValueError, match="nothing after '@'"):
        split_name("tokencake@ ")


def test_name_at_rev_is_the_system_with_the_revisions_full_commit(repo: Path):
    old = _git(repo, "rev-parse", "old")
    specs = resolve_systems(["tokencake@old", "offload-only@old", "tokencake", "tokencake@old"])
    assert [s.name for s in specs] == ["tokencake@old", "prefetch-off@old", "tokencake"]
    before = specs[0]
    assert before.source_commit == old and len(old) == 40
    assert SYSTEMS["tokencake"].source_commit is None
    # The same system otherwise: policy, flags, scheduler, options.
    assert {**before.to_dict(), "name": "tokencake"} == {
        **SYSTEMS["tokencake"].to_dict(),
        "source_commit": old,
    }


@pytest.mark.parametrize(
    "name, message",
    [
        ("fast@old", "unknown system 'fast'; choose from baseline, "),
        ("tokencake@nope", "unknown git revision 'nope' in "),
        ("tokencake@--all", "unknown git revision '--all' in "),
        ("tokencake@README.md", "unknown git revision 'README.md' in "),
    ],
)
def test_unknown_name_or_revision_is_a_one_line_error(repo: Path, name: str, message: str):
    with pytest.raises(ValueError) as err:
        resolve_systems([name])
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_the_cli_says_a_bad_revision_in_one_line(repo: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["bench", "--dry-run", "--systems", "tokencake@nope,tokencake"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokencake: error: unknown git revision 'nope'") and err.count("\n") == 1


def test_a_package_outside_git_cannot_name_a_revision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    fake = tmp_path / "site" / "tokencake" / "bench" / "revisions.py"
    monkeypatch.setattr(revisions, "__file__", str(fake))
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    fake.parent.mkdir(parents=True)
    with pytest.raises(ValueError, match=r"NAME@REV needs the running tokencake \(.*site.*\) to be a git"):
        resolve_revision("HEAD")


def test_the_export_holds_the_commits_package_only_and_leaves_the_checkout_alone(repo: Path, tmp_path: Path):
    old = _git(repo, "rev-parse", "old")
    state = [_git(repo, *cmd) for cmd in (["status", "--porcelain"], ["show-ref"], ["worktree", "list"])]
    root = export_tree(old, tmp_path / "src")
    assert root == tmp_path / "src" / old
    assert (root / "tokencake" / "__init__.py").read_text() == "VERSION = 'old'\n"
    assert not (root / "README.md").exists()
    assert sorted(p.name for p in (tmp_path / "src").iterdir()) == [old]  # no temporary left
    assert [
        _git(repo, *cmd) for cmd in (["status", "--porcelain"], ["show-ref"], ["worktree", "list"])
    ] == state
    # Once complete, an export is reused as it is; an incomplete one is redone.
    (root / "tokencake" / "__init__.py").write_text("touched\n")
    assert export_tree(old, tmp_path / "src") == root
    assert (root / "tokencake" / "__init__.py").read_text() == "touched\n"
    (root / revisions.COMPLETE_MARKER).unlink()
    export_tree(old, tmp_path / "src")
    assert (root / "tokencake" / "__init__.py").read_text() == "VERSION = 'old'\n"


def test_an_export_that_git_cannot_make_is_a_one_line_error(repo: Path, tmp_path: Path):
    with pytest.raises(ValueError, match=r"^cannot export 000000000000's tokencake/: .+$"):
        export_tree("0" * 40, tmp_path / "src")
    assert list((tmp_path / "src").iterdir()) == []


def test_server_of_a_revision_imports_its_export_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    tree = SourceTree("a" * 40, tmp_path / ("a" * 40))
    spec = dataclasses.replace(SYSTEMS["tokencake"], name="tokencake@a", source_commit="a" * 40)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    kwargs = server_kwargs(spec, ServerConfig(), Server, tree)
    assert kwargs["env"] == {"PYTHONPATH": f"{tree.root}{os.pathsep}/elsewhere", "PYTHONSAFEPATH": "1"}
    assert "tool_call_parser" not in kwargs
    plain = server_kwargs(SYSTEMS["tokencake"], ServerConfig(), Server)
    assert {k: v for k, v in kwargs.items() if k != "env"} == plain and "env" not in plain
    monkeypatch.delenv("PYTHONPATH")
    assert tree.env() == {"PYTHONPATH": str(tree.root), "PYTHONSAFEPATH": "1"}
    swapped = SourceTree(tree.commit, tree.root, tool_call_parser="hermes")
    assert server_kwargs(spec, ServerConfig(), Server, swapped)["tool_call_parser"] == "hermes"
    with pytest.raises(ValueError, match=r"needs the exported tree of a{40}$"):
        server_kwargs(spec, ServerConfig(), Server)
    with pytest.raises(ValueError, match="needs the exported tree"):
        server_kwargs(spec, ServerConfig(), Server, SourceTree("b" * 40, tree.root))


def test_a_tree_without_the_parser_plugin_gets_the_parser_it_extends(repo: Path, tmp_path: Path):
    old = _git(repo, "rev-parse", "old")
    tree = prepare_source(old, tmp_path / "src", ServerConfig())
    assert tree.tool_call_parser == "hermes"
    note, no_transparent = tree.differences
    assert note.startswith("--tool-call-parser hermes without --tool-parser-plugin") and PARSER_PLUGIN in note
    assert no_transparent.startswith("no transparent mode") and not tree.transparent
    assert tree.to_dict() == {"commit": old, "server_differences": [note, no_transparent]}
    # A tree that has the plug-in and the middleware is served with the launcher's flags unchanged.
    for module in (PARSER_PLUGIN, TRANSPARENT_MODULE):
        tree.root.joinpath(*module.split(".")).with_suffix(".py").write_text("")
    assert prepare_source(old, tmp_path / "src", ServerConfig()) == SourceTree(old, tree.root)


def test_a_tree_without_transparent_mode_starts_its_server_without_it(tmp_path: Path):
    spec = dataclasses.replace(SYSTEMS["tokencake"], name="tokencake@a", source_commit="a" * 40)
    old = SourceTree("a" * 40, tmp_path, transparent=False)
    assert server_kwargs(spec, ServerConfig(), Server, old)["transparent"] is False
    assert "transparent" not in server_kwargs(spec, ServerConfig(), Server, SourceTree("a" * 40, tmp_path))
    assert "transparent" not in server_kwargs(SYSTEMS["tokencake"], ServerConfig(), Server)


def test_a_missing_plugin_of_an_unknown_parser_is_an_error(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    args = ["--tool-parser-plugin", "x.y", "--enable-auto-tool-choice", "--tool-call-parser", "mine"]
    monkeypatch.setattr(revisions, "launcher_tool_args", lambda server: args)
    with pytest.raises(ValueError, match=r"has no x\.y \(tool-parser plug-in of 'mine'\)"):
        prepare_source(_git(repo, "rev-parse", "old"), tmp_path / "src", ServerConfig())
    monkeypatch.setattr(revisions, "launcher_tool_args", lambda server: ["--tool-call-parser", "mine"])
    tree = prepare_source(_git(repo, "rev-parse", "old"), tmp_path / "src", ServerConfig())
    assert tree.tool_call_parser is None
    assert not any(d.startswith("--tool-call-parser") for d in tree.differences)


def test_before_and_after_in_one_run(repo: Path, tmp_path: Path, fake_server: Any, fake_vllm: Any):
    stats = {"offload.bytes": 4096, "offload.blocks": 2}
    fake_server.make_backend = staticmethod(lambda server: fake_vllm(hit_fraction=0.5, stats=stats))

    class Revisable(fake_server):  # type: ignore[misc,valid-type]
        def __init__(
            self,
            *args: Any,
            env: Any = None,
            tool_call_parser: Any = None,
            transparent: Any = None,
            **kw: Any,
        ) -> None:
            super().__init__(*args, **kw)
            self.kwargs |= {"env": env, "tool_call_parser": tool_call_parser, "transparent": transparent}

    # server_kwargs reads the keywords a server class accepts from its signature.
    fake = inspect.signature(fake_server)
    extra = [
        inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=None)
        for k in ("env", "tool_call_parser", "transparent")
    ]
    Revisable.__signature__ = fake.replace(parameters=[*fake.parameters.values(), *extra])  # type: ignore[attr-defined]

    old = _git(repo, "rev-parse", "old")
    tiny = dict(apps=2, turns=2, context_tokens=30, max_tokens=5, tool_s=(0.0, 0.02), repeat=2)
    config = presets.build("ci", presets.Overrides(systems=["tokencake@old", "tokencake"], **tiny))
    results = run_bench(
        config,
        server_cls=Revisable,
        log_dir=tmp_path / "out" / "logs",
        transport=lambda: Revisable.instances[-1].backend.transport(),
        src_dir=tmp_path / "out" / ".src",
    )
    assert results["valid"], results["warnings"]
    # Each server's log is "<point>#<round>-<system>.log".
    env = {
        s.kwargs["log_file"].rsplit("-", 1)[1][: -len(".log")]: s.kwargs["env"] for s in Revisable.instances
    }
    assert env == {"tokencake@old": SourceTree(old, tmp_path / "out" / ".src" / old).env(), "tokencake": None}
    assert len(Revisable.instances) == 2 * 2
    assert results["sources"]["tokencake@old"]["commit"] == old
    assert results["config"]["systems"][0]["source_commit"] == old
    key = "tokencake/tokencake@old"
    assert all(key in p["comparison"] for p in results["points"])
    agg = results["aggregate"]["ci"]
    assert key in agg["rounds"] and agg["paired"][key]["n_pairs"] == 2 * 2

    console = Console(record=True, width=200)
    terminal.render(results, console)
    text = console.export_text()
    assert f"E2E {key}: mean " in text and f"tokencake@old: server code of commit {old}" in text

    md = markdown(results)
    assert f"- tokencake@old: server code of commit {old}" in md
    assert "--tool-call-parser hermes without --tool-parser-plugin" in md and "no transparent mode" in md
    started = {s.kwargs["log_file"].rsplit("-", 1)[1][: -len(".log")]: s.kwargs for s in Revisable.instances}
    assert started["tokencake@old"]["transparent"] is False and started["tokencake"]["transparent"] is None
    assert f"| {key} |" in md and "E2E mean tokencake/tokencake@old (running code / revision old)" in md
