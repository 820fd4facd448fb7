"""Every number README and docs quote from a benchmark is the one its stored results.json holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokencake.bench.claims import ClaimError, claims, main, render

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_quoted_numbers_match_their_stored_results(path: Path) -> None:
    text = path.read_text()
    assert render(text, where=path.name) == text, (
        f"{path.name}: a quoted number differs from its results.json; "
        f"run `python -m tokencake.bench.claims --write {path.relative_to(ROOT)}`"
    )


def test_the_readme_headline_is_backed() -> None:
    quoted = claims((ROOT / "README.md").read_text())
    assert len(quoted) >= 2
    assert all((ROOT / "docs" / "bench" / f).is_file() for f, *_ in quoted)


def test_render_formats_and_errors(tmp_path: Path) -> None:
    (tmp_path / "r.json").write_text(
        json.dumps({"a": {"x/y": {"mean": 0.5, "ci95": [0.25, 0.75]}, "n": 1234.5, "c": "abcdef0123"}})
    )
    text = (
        "<!--bench r.json a|x/y ci2-->old<!--/bench--> <!--bench r.json a|x/y ci%-->old<!--/bench--> "
        "<!--bench r.json a|n ,.0f-->old<!--/bench--> <!--bench r.json a|c .7s-->old<!--/bench-->"
    )
    out = render(text, tmp_path)
    assert [v for *_x, v in claims(out)] == ["0.50 [0.25, 0.75]", "50 % [25 %, 75 %]", "1,234", "abcdef0"]
    (tmp_path / "p.json").write_text(json.dumps({"t/i": {"ratio": 1.0741, "ci95": [1.057, 1.0949]}}))
    assert claims(render("<!--bench p.json t/i pci2-->x<!--/bench-->", tmp_path))[0][3] == "1.07 [1.06, 1.09]"
    with pytest.raises(ClaimError, match="paired"):  # a rounds entry has a mean, not a ratio
        render("<!--bench r.json a|x/y pci2-->x<!--/bench-->", tmp_path)
    with pytest.raises(ClaimError, match="does not resolve"):
        render("<!--bench r.json a|missing .2f-->1<!--/bench-->", tmp_path)
    with pytest.raises(ClaimError, match="not found"):
        render("<!--bench nope.json a .2f-->1<!--/bench-->", tmp_path)
    (tmp_path / "l.json").write_text(json.dumps({"points": [1.0, 2.0]}))
    assert render("<!--bench l.json points|-1 .1f-->x<!--/bench-->", tmp_path).count("2.0") == 1
    with pytest.raises(ClaimError, match="does not resolve"):  # a list index out of range
        render("<!--bench l.json points|4 .1f-->x<!--/bench-->", tmp_path)
    # A marker the pattern cannot parse would be skipped, and its number never checked.
    with pytest.raises(ClaimError, match=":2: malformed marker"):
        render("ok\n<!--bench l.json  points|0 .1f-->x<!--/bench-->", tmp_path)
    with pytest.raises(ClaimError, match="malformed marker"):
        render("<!--bench l.json points|0 .1f-->x<!--/bench>", tmp_path)


def test_check_and_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tokencake.bench.claims as mod

    (tmp_path / "r.json").write_text(json.dumps({"v": 2.0}))
    monkeypatch.setattr(mod, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(mod, "render", lambda text, where="": render(text, tmp_path, where=where))
    doc = tmp_path / "d.md"
    doc.write_text("x <!--bench r.json v .1f-->1.0<!--/bench-->")
    assert main([str(doc)]) == 1
    assert main(["--write", str(doc)]) == 0
    assert "2.0<!--/bench-->" in doc.read_text() and main(["--check", str(doc)]) == 0


def test_render_reads_a_rewritten_source_again(tmp_path: Path) -> None:
    src = tmp_path / "r.json"
    src.write_text(json.dumps({"n": 1.0}))
    text = "<!--bench r.json n .1f-->x<!--/bench-->"
    assert claims(render(text, tmp_path))[0][3] == "1.0"
    src.write_text(json.dumps({"n": 22.0}))  # a generator rewrites its summary, then renders again
    assert claims(render(text, tmp_path))[0][3] == "22.0"
