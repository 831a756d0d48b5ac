# Every target creates .venv and installs what it needs; running one twice
# reinstalls nothing. torch (when a later target needs it) comes from
# constraints.txt, pinned to the CPU build.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --quiet --constraint constraints.txt
STAMP  := $(VENV)/.installed

.PHONY: demo test test-all bench experiment-cpt system-deps clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstall only when the project's requirements change.
$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PIP) -e '.[test,ray,kernels]'
	@touch $@

# bubblewrap provides the sandboxes; chromium renders the HTML report in its
# test. Installed with apt when missing and we are root; otherwise we say how
# to get them (the tests that need them then skip, saying why).
SYSTEM_PACKAGES := bwrap:bubblewrap chromium:chromium
system-deps:
	@missing=""; for pair in $(SYSTEM_PACKAGES); do \
	  command -v "$${pair%%:*}" >/dev/null 2>&1 || missing="$$missing $${pair#*:}"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) \
	      || echo "warning: could not install:$$missing"; \
	  else \
	    echo "note: missing system packages:$$missing (Debian/Ubuntu: sudo apt-get install$$missing)"; \
	  fi; fi

demo: $(STAMP) system-deps
	$(VENV)/bin/atelier run recipes/demo.toml --out runs/demo

test: $(STAMP) system-deps
	$(PY) -m pytest

test-all: $(STAMP) system-deps
	$(PY) -m pytest -m ''

bench: $(STAMP) system-deps
	$(PY) benchmarks/sandbox.py

# The report's CPT-loss-to-RL-reward finding at small scale (about 30 minutes on 2 cores).
experiment-cpt: $(STAMP)
	$(PY) experiments/cpt_scaling/run.py --out runs/cpt-scaling

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
