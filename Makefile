# Two entry points: `make demo` and `make test`. Each sets everything up from a fresh clone first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: setup demo retrieval-example test bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned to the CPU wheel on disk: a looser spec would pull a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	HF_HUB_OFFLINE=1 $(PY) examples/demo.py

retrieval-example: setup  # docs/retrieval-example.md: mine, fine-tune, evaluate, distil, export, serve (real data)
	HF_HUB_OFFLINE=1 $(PY) examples/retrieval.py

test: setup
	@# the dashboard test drives Debian's chromium (never a downloaded browser); without root/apt it skips, saying why
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium; } || echo "chromium not installed: the dashboard test will skip"
	@# the store and chaos tests start a throwaway PostgreSQL from Debian's binaries (/usr/lib/postgresql/*/bin, off PATH)
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq postgresql; } || echo "postgresql not installed: the PostgreSQL tests will skip (and fail under CI=true)"
	@# on two pytest-xdist workers, a test file whole on one (pyproject's addopts: -n 2 --dist loadfile)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

bench: setup
	HF_HUB_OFFLINE=1 $(PY) scripts/bench.py
	HF_HUB_OFFLINE=1 $(PY) scripts/bench_deberta.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
