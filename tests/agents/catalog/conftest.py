import tempfile
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _sandboxes_in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs without ``workdir`` create their sandboxes in the system temp dir: keep them in tmp_path."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
