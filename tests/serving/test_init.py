"""``tokencake.serving``'s public names: the package's ``__all__`` is API, pinned here."""

from __future__ import annotations

import tokencake.serving as serving


def test_the_public_names_of_the_package_resolve() -> None:
    assert sorted(serving.__all__) == [
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
    assert all(getattr(serving, name, None) is not None for name in serving.__all__)
