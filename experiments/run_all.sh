#!/bin/sh
# Run every experiment one after the other, single-threaded, in the priority order of issue 8.
# Each script is resumable: re-running this file continues where the previous invocation stopped.
# Usage: sh experiments/run_all.sh   (from the repository root)
set -e
PY=${PY:-.venv/bin/python}
$PY experiments/exp1_vision.py
$PY experiments/exp4_compression.py
$PY experiments/exp3_whitebox.py
$PY experiments/exp5_language.py
$PY experiments/exp2_ablations.py
$PY experiments/exp6_listops.py
$PY experiments/exp7_efficiency.py
$PY experiments/exp8_plain_vit.py
$PY experiments/exp9_lra.py
