"""Experiment 2: ablations (ToST Table 8, DMSA Tables II-III, ECA softplus / rank / expansion).

Each variant is a model of experiment 1 (same shell, data and budget, seed 0) with some
constructor arguments changed; a variant without changes reuses experiment 1's run. Rows whose
option the library lacks are reported as pending. For ECA runs the learned expansion / compression
strengths alpha, beta per layer are recorded too (ECA Fig. 7-8).

Writes ``experiments/results/exp2_ablations/{ablations.csv, results.json}``.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
import exp1_vision as E1  # noqa: E402

NAME = "exp2_ablations"


def _merge(a: dict, b: dict) -> dict:
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = _merge(out.get(k, {}), v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def eca_strengths(run_dir: Path) -> dict:
    """alpha, beta (mean over heads where per head) of every ECA layer of a trained model."""
    model = C.load_trained(run_dir)
    alphas, betas = [], []
    for blk in model.blocks:
        attn = blk.attn
        if not hasattr(attn, "alpha"):
            continue
        a, b = attn.alpha, attn.beta
        alphas.append(None if a is None else float(a.detach().mean()))
        betas.append(None if b is None else float(b.detach().mean()))
    return {"alpha": alphas, "beta": betas}


def main(argv=None) -> int:
    import argparse

    import yaml

    args = C.parser(NAME, __doc__.splitlines()[0]).parse_args(argv)
    setup = C.Setup(NAME, args)
    cfg = setup.cfg
    # the base experiment's settings, in the same mode (smoke or full)
    with open(C.CONFIG_DIR / f"{cfg['base_config']}.yaml", encoding="utf-8") as f:
        base_all = yaml.safe_load(f)
    base = argparse.Namespace(config=str(C.CONFIG_DIR / f"{cfg['base_config']}.yaml"), smoke=setup.smoke,
                              out=str(setup.out), runs=str(setup.runs.parent / cfg["base_config"]),
                              max_minutes=None)
    e1 = C.Setup.__new__(C.Setup)
    e1.cfg = dict(base_all["smoke" if setup.smoke else "full"])
    e1.runs = Path(base.runs)
    rows = []
    for v in cfg["variants"]:
        row = {"name": v["name"], "group": v["group"], "base": v["base"], "args": v.get("args")}
        if v.get("pending"):
            rows.append({**row, "status": "pending the option", "note": v["pending"]})
            continue
        kw = E1.train_kwargs(e1, v["base"], cfg["seed"])
        kw["model_args"] = _merge(kw["model_args"], v.get("args") or {})
        reuse = e1.runs / f"{v['base']}_s{cfg['seed']}"
        rd = reuse if not v.get("args") and C.read_json(reuse / "result.json") is not None else setup.runs / v["name"]
        if C.read_json(rd / "result.json") is None and not setup.time_left():
            rows.append({**row, "status": "not run yet"})
            print(f"[{NAME}] time budget reached; not starting {v['name']} (re-run to continue)")
            continue
        print(f"[{NAME}] {v['name']} -> {rd}", flush=True)
        res = C.train_run(rd, **kw)
        row.update(status="done", run_dir=str(rd), params=res["params"], test_acc=res["final_eval"]["acc"],
                   train_img_per_s=res["train_samples_per_s"])
        if v["base"] == "eca":
            row.update(eca_strengths(rd))
        rows.append(row)
        print(f"[{NAME}]   acc {row['test_acc']:.4f}", flush=True)
    C.write_csv(setup.out / "ablations.csv", [{k: r.get(k) for k in ("name", "group", "status", "params", "test_acc",
                                                                    "train_img_per_s", "args")} for r in rows])
    C.write_json(setup.out / "results.json", {"config": cfg, "command": setup.command(NAME), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
