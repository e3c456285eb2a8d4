# whiteformer: the two commands a new user runs are `make demo` and `make test`.
# Both create .venv if missing and install what is needed, idempotently.
# torch is pinned and installed *before* the project so pip never resolves an
# unpinned torch (which would pull the CUDA build).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP  := $(VENV)/.installed-stamp
TEST_STAMP := $(VENV)/.installed-test-stamp

.PHONY: demo test install clean bench

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -e ".[all]"
	touch $(STAMP)

# the tests also run the Triton kernels through Triton's interpreter: install the [triton] extra
$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -e ".[all,triton]"
	touch $(TEST_STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m whiteformer.demo

test: $(TEST_STAMP)
	$(PY) -m pytest tests

bench: $(STAMP)
	$(PY) -m benchmarks.run

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
