"""Serving side of TokenCake: stock vLLM plus the TokenCake extension, on CPU or GPU.

``Server`` launches and stops a vLLM OpenAI server (with the extension, or ``baseline=True``
without); ``prepare_model`` converts the bundled SmolLM2 GGUF into an HF directory once. Neither
imports vLLM: this package stays importable in a client-only install.
"""

from tokencake.serving.model import (
    DEFAULT_MODEL_NAME,
    ModelError,
    ResolvedModel,
    default_model_dir,
    find_gguf,
    is_prepared,
    prepare_model,
    resolve_model,
    tokencake_home,
)
from tokencake.serving.prometheus import parse_prometheus
from tokencake.serving.server import (
    Server,
    ServerError,
    find_free_port,
    port_is_free,
    stop_process_group,
)

__all__ = [
    "DEFAULT_MODEL_NAME",
    "ModelError",
    "ResolvedModel",
    "Server",
    "ServerError",
    "default_model_dir",
    "find_free_port",
    "find_gguf",
    "is_prepared",
    "parse_prometheus",
    "port_is_free",
    "prepare_model",
    "resolve_model",
    "stop_process_group",
    "tokencake_home",
]
