# Two commands on a fresh machine:  `make demo`  and  `make test`.
# Both create .venv on first use. On a CPU machine torch is pinned to 2.13.0, the CPU wheel.
PY := .venv/bin/python
TORCH ?= torch==2.13.0
PROMPT ?= The quick brown fox
STAGE ?= nanovllm_final

.PHONY: demo test install clean

install: .venv/.installed

.venv/.installed: pyproject.toml
	python3 -m venv .venv
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# Generate text with the built-in tiny model (random weights, so the text is gibberish).
demo: install
	$(PY) -m tools.tiny_model .models/tiny-qwen3 --arch qwen3 --shape tiny --if-missing
	$(PY) -m $(subst /,.,$(STAGE)) --model .models/tiny-qwen3 --prompt "$(PROMPT)" --max-tokens 32

# The whole suite: the stage tool's check, then the unit and equivalence tests and every notebook
# under nbval, in one pytest run spread over one worker per core (pytest-xdist; WORKERS=0: all in one process).
WORKERS ?= auto
test: install
	$(PY) -m tools.stages check
	$(PY) -m pytest -n $(WORKERS) tests notebooks --nbval

clean:
	rm -rf .venv .models
