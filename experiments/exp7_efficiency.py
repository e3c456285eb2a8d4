"""Experiment 7: index the benchmark suite's result files next to the papers' efficiency figures.

Does not run any benchmark (the suite is ``python -m benchmarks.run``, see docs/benchmarks.md);
lists which result files exist for each target (``*.json``, ``*.png``, ``*.md`` whose name starts
with the target's pattern) and writes ``experiments/results/exp7_efficiency/index.json``.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

NAME = "exp7_efficiency"


def main(argv=None) -> int:
    args = C.parser(NAME, __doc__.splitlines()[0]).parse_args(argv)
    setup = C.Setup(NAME, args)
    cfg = setup.cfg
    rdir = C.REPO / cfg["results_dir"]
    index = {"command": setup.command(NAME), "results_dir": cfg["results_dir"], "targets": {}}
    files = sorted(p for p in rdir.rglob("*") if p.is_file() and p.suffix in (".json", ".png", ".md")) \
        if rdir.is_dir() else []
    for target, figure in cfg["figures"].items():
        pattern = cfg.get("patterns", {}).get(target, target)
        mine = [str(p.relative_to(C.REPO)) for p in files if p.name.startswith(pattern)]
        index["targets"][target] = {"paper_figure": figure, "files": mine,
                                    "status": "available" if mine else "not run yet"}
        print(f"[{NAME}] {target}: {len(mine)} file(s) ({figure})")
    C.write_json(setup.out / "index.json", index)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
