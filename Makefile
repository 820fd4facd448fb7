# TokenCake developer entry points. Everything runs inside $(VENV) (created on demand).
#   make demo         venv + model + embedded server + the deep-research catalog app, then stop
#   make test         make lint + the whole pytest suite (integration tests start real vLLM-CPU servers)
#   make unit         tests without a server (-m "not integration")
#   make lint         ruff check + ruff format --check
# Outside this machine, the CPU torch wheel comes from the PyTorch index:
#   make demo PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu

VENV ?= .venv
PYTHON ?= python3
EXTRAS ?= dev,serve-cpu
PIP_EXTRA_INDEX_URL ?=
PYTEST_ARGS ?=
DEMO_APP ?= deep-research
# 40 device blocks of 128 tokens: the researchers' documents do not all fit, so the extension's
# offload / host hits show in the summary (the default KV size never evicts anything).
DEMO_ARGS ?= --device-blocks 40

comma := ,
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tokencake-$(subst $(comma),-,$(EXTRAS)).stamp

.PHONY: venv model demo serve test unit integration lint format

venv: $(STAMP)

# Re-run the install only when the package metadata or the install script changed.
$(STAMP): pyproject.toml scripts/install_serve_cpu.sh
	VENV="$(VENV)" PYTHON="$(PYTHON)" EXTRAS="$(EXTRAS)" PIP_EXTRA_INDEX_URL="$(PIP_EXTRA_INDEX_URL)" \
		sh scripts/install_serve_cpu.sh
	touch "$@"

model: venv
	$(PY) -m tokencake model prepare

demo: model
	$(PY) -m tokencake run $(DEMO_APP) --serve $(DEMO_ARGS)

serve: model
	$(PY) -m tokencake serve

# Lint first: a formatting or lint error fails CI before the (long) suite starts.
test: lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

unit: venv
	$(PY) -m pytest -q -m "not integration" $(PYTEST_ARGS)

integration: model
	$(PY) -m pytest -q -m integration $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: venv
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .
