"""Experiment 3: white-box behaviour of the trained models of experiment 1.

Layer-wise coding rates (R, R_c, R_c^var, R_c(Z|U)) of each block's output on test digits
(ToST Fig. 4a and DMSA Fig. 5 claim that R_c^var falls with depth in trained models), also of
each attention layer's (normalised) input when ``features`` lists "input", and the
memberships Pi of the last and first attention blocks drawn over the patch grid.

Needs experiment 1's seed-``seed`` runs (missing ones are reported and skipped). Writes
``experiments/results/exp3_whitebox/{rates.csv, summary.json, <model>/layerwise_report.{json,png},
<model>/input/layerwise_report.{json,png},
<model>/memberships_last.png, <model>/memberships_first.png}``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

NAME = "exp3_whitebox"


def main(argv=None) -> int:
    from whiteformer.analysis import layerwise_report, membership_maps
    from whiteformer.app.data import build_dataset
    from whiteformer.models import create_model

    args = C.parser(NAME, __doc__.splitlines()[0]).parse_args(argv)
    setup = C.Setup(NAME, args)
    cfg = setup.cfg
    src = setup.runs.parent / cfg["source"]
    kw = {"data_dir": cfg.get("data_dir") or str(C.MNIST_DIR)} if cfg["dataset"] == "mnist" else {}
    test = build_dataset(cfg["dataset"], "test", **kw)
    images, labels = C.image_batch(test, cfg["num_images"])
    rows, summary = [], {"config": cfg, "command": setup.command(NAME), "models": {}, "missing": []}
    todo = [(k, False) for k in cfg["models"]] + [(k, True) for k in cfg.get("untrained", [])]
    for key, untrained in todo:
        run = src / f"{key}_s{cfg['seed']}"
        res = C.read_json(run / "result.json")
        if res is None:
            print(f"[{NAME}] {run} has no result.json (experiment 1 not run yet): skipped")
            summary["missing"].append(str(run))
            continue
        if untrained:
            torch.manual_seed(cfg["seed"])
            model = create_model(res["model"], img_size=images.shape[-1], in_chans=images.shape[1],
                                 num_classes=10, **res["model_args"]).eval()
            tag = f"{key}_init"
        else:
            model = C.load_trained(run)
            tag = key
        out = setup.out / tag
        entry = {}
        for features in cfg.get("features", ["output"]):
            # "output": each block's output tokens (the papers' curves); "input": each attention
            # layer's input (after the block's norm, so its scale does not grow with depth)
            sfx = "" if features == "output" else f"_{features}"
            rep = layerwise_report(model, images, eps=cfg["eps"], out_dir=out if not sfx else out / features,
                                   features=features)
            for r in rep.rows:
                rows.append({"model": tag, "features": features,
                             **{k: r[k] for k in ("layer", "name", "attn", "R", "R_c", "delta_R", "R_c_var",
                                                  "delta_R_var", "R_c_U")}})
            var = [r["R_c_var"] for r in rep.rows if r.get("R_c_var") is not None]
            entry.update({f"R_c_var{sfx}": var, f"R_c_U{sfx}": [r["R_c_U"] for r in rep.rows],
                          f"R{sfx}": [r["R"] for r in rep.rows]})
            entry["layers"] = [r["name"] for r in rep.rows]
            if len(var) >= 2:
                entry[f"R_c_var{sfx}_first_last"] = [var[0], var[-1]]
                entry[f"R_c_var{sfx}_monotone_decreasing"] = all(b <= a for a, b in zip(var, var[1:]))
        if key in cfg.get("maps", []) and not untrained:
            for layer, nm in ((-1, "last"), (0, "first")):
                membership_maps(model, images[: cfg["map_images"]], out / f"memberships_{nm}.png", layer=layer,
                                max_images=cfg["map_images"])
        summary["models"][tag] = entry
        print(f"[{NAME}] {tag}: R_c_var per layer {['%.2f' % v for v in entry['R_c_var']]}", flush=True)
    C.write_csv(setup.out / "rates.csv", rows)
    summary["labels_of_map_images"] = labels[: cfg["map_images"]].tolist()
    C.write_json(setup.out / "summary.json", summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
