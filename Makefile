# whiteformer: the two commands a new user runs are `make demo` and `make test`.
# Both create .venv if missing and install what is needed, idempotently.
# torch is pinned and installed *before* the project so pip never resolves an
# unpinned torch (which would pull the CUDA build).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# the Triton whose interpreter runs the kernels in the tests (a CPU torch pins none)
TRITON_VERSION ?= 3.9.0
STAMP  := $(VENV)/.installed-stamp
TEST_STAMP := $(VENV)/.installed-test-stamp

.PHONY: demo test lint install clean bench gpu-wheels gpu-check-dry version-matrix triton-matrix

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -e ".[all]"
	touch $(STAMP)

# the tests also run the Triton kernels through Triton's interpreter: install the [triton] extra
$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install "triton==$(TRITON_VERSION)"
	$(PY) -m pip install -e ".[all,triton]"
	touch $(TEST_STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m whiteformer.app.demo

test: lint
	$(PY) -m pytest tests

# ruff (pinned in the [test] extra; rules in pyproject.toml): `$(PY) -m ruff check --fix .` sorts imports
lint: $(TEST_STAMP)
	$(PY) -m ruff check .

bench: $(STAMP)
	$(PY) -m benchmarks.run

# pure-Python wheels the GPU check installs on a GPU machine that has torch / Triton / transformers
# but no package index: `python -m benchmarks.gpu_check --wheels $(GPU_WHEELS) --out DIR`
GPU_WHEELS ?= build/gpu-wheels
gpu-wheels:
	$(PYTHON) -m pip download --no-deps --only-binary=:all: -d $(GPU_WHEELS) -r benchmarks/gpu_check/requirements.txt

# the GPU check's whole pipeline on this CPU (Triton's interpreter, tiny sizes)
gpu-check-dry: $(TEST_STAMP)
	$(PY) -m benchmarks.gpu_check --dry-run --overwrite --out build/gpu-check-dry

# the fast test subset under torch 2.11 and the newest torch, in scratch environments outside the
# repository (VERSION_MATRIX_ENVS: torch2.11,torch2.15,torch2.7); results: benchmarks/results/version_matrix.json
VERSION_MATRIX_ENVS ?= torch2.11,torch2.15
version-matrix:
	$(PYTHON) tools/version_matrix.py --envs $(VERSION_MATRIX_ENVS)

# the kernels' compile check (sm_80, sm_90; the whole launch list, per kernel: compiles, failures,
# stack frames) and interpreter tests under each Triton from 3.3 to 3.9; results:
# benchmarks/results/triton_matrix.json (make test runs a subset on the installed Triton only).
# TRITON_DIRS: folders of `pip install --no-deps --target DIR triton==X` installs, one per release
# (e.g. TRITON_DIRS="/opt/triton-3.3 /opt/triton-3.9"); empty: each wheel is downloaded once and
# installed under ~/.cache/whiteformer-triton (never into $(VENV)). TRITON_MATRIX_ARGS: more options
# (e.g. --skip-tests, --jobs 1)
TRITON_DIRS ?=
TRITON_MATRIX_ARGS ?=
triton-matrix: $(TEST_STAMP)
	$(PY) -m benchmarks.triton_matrix $(if $(strip $(TRITON_DIRS)),--dirs "$(TRITON_DIRS)") $(TRITON_MATRIX_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
