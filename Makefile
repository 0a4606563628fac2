# Two commands on a fresh machine:  `make demo`  and  `make test`.  `make` alone lists the rest.
# Every target runs in .venv (created by `make install`, on first use), so no activation is needed.
PY := .venv/bin/python
TORCH ?= torch==2.13.0
# Where pip gets torch. Empty: pip's own configuration. On this course's machines that configuration
# serves the CPU wheel; on an ordinary CPU-only Linux box, plain `pip install torch` would fetch the
# multi-GB CUDA build, so there run:  make install TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
PROMPT ?= Once upon a time
STAGE ?= nanovllm_final
COURSE := models/course-llama
TINY := .models/tiny-qwen3
MODEL ?= $(COURSE)
ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help demo test lint install notebooks book stage clean

help:
	@echo "make demo       set up .venv, then the final engine tells a story with the course model (greedy; TEMPERATURE=0.8 samples)"
	@echo "make test       the whole suite: stage-tool check, pytest, every notebook under nbval"
	@echo "make lint       ruff: the lint rules and the formatter's check (pyproject.toml [tool.ruff])"
	@echo "make stage      one stage on a model:  make stage STAGE=03 PROMPT='Hello' [MODEL=dir] [ARGS='--max-tokens 16']"
	@echo "                (STAGE: 01..07, a name such as 03_paged or paged, or final (the default); MODEL: the course model,"
	@echo "                $(TINY) for the tiny random one, or any checkpoint directory)"
	@echo "make notebooks  install JupyterLab (the 'notebook' extra) and open notebooks/"
	@echo "make book       the course book: notebooks/ as they are committed (outputs included, nothing re-run) -> _book/"
	@echo "make install    only create .venv (torch: TORCH=$(TORCH), TORCH_INDEX=$(if $(TORCH_INDEX),$(TORCH_INDEX),pip's configuration))"
	@echo "make clean      remove .venv and .models"
	@echo "Anything else: run it with $(PY), or after 'source .venv/bin/activate' with python."

install: .venv/.installed

.venv/.installed: pyproject.toml
	@echo "== Setting up .venv (once): torch ($(TORCH), from $(if $(TORCH_INDEX),$(TORCH_INDEX),pip's configured index)),"
	@echo "   then this repository in editable mode with its test tools (the 'dev' extra: transformers, pytest, nbval, ...)."
	@echo "   The first time this downloads several hundred MB and takes a few minutes; pip shows its progress below."
	$(if $(TORCH_INDEX),,@echo "   CPU-only Linux machine? Unless your pip serves CPU wheels, Ctrl-C now and run")
	$(if $(TORCH_INDEX),,@echo "   make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu  (or pip fetches the multi-GB CUDA torch)")
	python3 -m venv .venv
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --progress-bar on "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install --progress-bar on -e ".[dev]"
	touch $@
	@echo "== .venv is ready (later runs skip this step)."

# A story from the course model (models/course-llama: a 5.2M-parameter Llama trained here), final engine.
# Greedy by default, so the demo, the README and `nanovllm serve` at temperature 0 tell the same story.
TEMPERATURE ?= 0
demo: install
	@echo "== The final engine (nanovllm_final) continues \"$(PROMPT)\" with the course model ($(COURSE)), on this"
	@echo "   machine's CPU or GPU: 64 tokens, $(if $(filter 0 0.0,$(TEMPERATURE)),greedy (temperature 0: the same story every run; TEMPERATURE=0.8 samples),sampled at temperature $(TEMPERATURE))."
	$(PY) -m nanovllm_final generate --model $(COURSE) --prompt "$(PROMPT)" --max-tokens 64 --temperature $(TEMPERATURE)
	@echo "== Next: make test (the whole suite), make notebooks (the course), make help (everything else)."

# The whole suite: the stage tool's check, then the unit and equivalence tests and every notebook
# under nbval, in one pytest run spread over one worker per core (pytest-xdist; WORKERS=0: all in one process).
WORKERS ?= auto
test: install
	$(PY) -m tools.stages check
	$(PY) -m pytest -n $(WORKERS) tests notebooks --nbval

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# One stage, named any way `stages.load` accepts (03, 3, 03_paged, paged, final, ...).
stage: install
ifeq ($(MODEL),$(TINY))
	$(PY) -m tools.tiny_model $(TINY) --arch qwen3 --shape tiny --if-missing
endif
	$(PY) -m stages $(STAGE) --model "$(MODEL)" --prompt "$(PROMPT)" $(ARGS)

.venv/.notebook: .venv/.installed
	$(PY) -m pip install -q -e ".[dev,notebook]"
	touch $@

# JupyterLab on notebooks/ (add JUPYTER_ARGS='--no-browser --ip=0.0.0.0' on a remote machine).
notebooks: .venv/.notebook
	$(PY) -m jupyter lab --notebook-dir=notebooks $(JUPYTER_ARGS)

.venv/.book: .venv/.installed
	$(PY) -m pip install -q -e ".[dev,book]"
	touch $@

# The course book (MkDocs Material + mkdocs-jupyter; mkdocs.yml): notebooks/README.md and the notebooks
# with their committed outputs, nothing re-executed, once every listing in them is checked against the code
# (tools/listings.py). Open _book/index.html from disk, or read it at http://127.0.0.1:8000 after
# `$(PY) -m http.server -d _book -b 127.0.0.1 8000`.
book: .venv/.book
	$(PY) -m tools.listings check
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build -q
	@echo "built _book/; open _book/index.html in a browser, or serve it: $(PY) -m http.server -d _book -b 127.0.0.1 8000"

clean:
	rm -rf .venv .models _book
