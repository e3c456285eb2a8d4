"""Runs parts of the GPU check in a process of their own (``python -m benchmarks.gpu_check._child
PART[,PART...] SPEC.json``), one after the other, each guarded: the driver gives the process a
time limit, and a crash or a hung kernel loses only what had not finished. SPEC holds the
configuration and each part's result path."""
from __future__ import annotations

import importlib
import json
import sys
import traceback

from .record import Recorder, describe

PARTS = {"env": "environment", "correctness": "correctness", "ops": "ops_stack", "stack": "ops_stack",
         "bandwidth": "bandwidth", "fla": "fla_side", "lm": "lm_step", "lm_linearized": "lm_more",
         "lm_packed": "lm_more"}


def run_part(part: str, cfg, path) -> bool:
    rec = Recorder(path, part)
    module = importlib.import_module(f"{__package__}.{PARTS[part]}")
    run = getattr(module, f"run_{part}", None) or module.run
    try:
        run(cfg, rec)
    except Exception as e:  # noqa: BLE001 - the part failed: say why in its file, go on with the next
        rec.set(status=f"failed: {describe(e)}", traceback=traceback.format_exc()[-4000:])
        return False
    if rec.data["status"] == "running":
        rec.set(status="ok")
    return True


def main(argv=None) -> int:
    parts, spec_path = (argv if argv is not None else sys.argv[1:])[:2]
    with open(spec_path) as f:
        spec = json.load(f)
    ok = True
    for part in parts.split(","):
        print(f"--- {part}", flush=True)
        ok = run_part(part, spec["config"], spec["outs"][part]) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
