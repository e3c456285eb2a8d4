"""Part (d) of the GPU check: one training step of the 12-layer base language models, causal
ToST (``tost_lm_base``, causal TSSA on the Triton path) vs GPT (``gpt_base`` with
``F.scaled_dot_product_attention``), at 4k and 8k tokens, batch 1, bfloat16 autocast: median
time of the steps (the models alternate, after a warm-up step each) and peak memory of one step
(model weights excluded). ToST Table 4 reports ToST / GPT2 at 4k: 0.60x time, 0.41x memory; at
8k: 0.46x time, 0.24x memory (:data:`benchmarks.lm_model.PAPER`)."""
from __future__ import annotations

import contextlib
import statistics
from typing import Any, Dict

import torch

from .. import gpu, lm_model
from .record import describe

FULL = dict(config="base", contexts=[4096, 8192], repeats=3)
DRY = dict(config="tiny", contexts=[32], repeats=1)


def run(cfg: Dict[str, Any], rec) -> None:
    device = cfg["device"]
    plan = DRY if cfg["dry_run"] else FULL
    models_cfg = lm_model.CONFIGS[plan["config"]]
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda")
                else contextlib.nullcontext())
    rec.set(config=plan["config"], model_args=models_cfg, autocast="bfloat16" if device.startswith("cuda") else None,
            paper=lm_model.PAPER, loss="plain (the logits formed whole, as nanoGPT)")
    models = {k: lm_model.build_model(k, models_cfg, device) for k in ("tost", "gpt_sdpa")}
    gen = torch.Generator().manual_seed(0)

    def step(model, idx):
        with gpu.backend("triton"), autocast:
            lm_model._step(model, idx, "train", None)

    for T in plan["contexts"]:
        idx = torch.randint(0, models_cfg["vocab_size"], (1, T), generator=gen).to(device)
        rows = {k: {"model": k, "context": T} for k in models}
        try:
            for k, m in models.items():
                step(m, idx)  # warm-up at this size
            times = {k: [] for k in models}
            for _ in range(plan["repeats"]):
                for k, m in models.items():
                    times[k].append(gpu.cuda_time(lambda m=m: step(m, idx), device))
            for k, m in models.items():
                m.zero_grad(set_to_none=True)
                rows[k]["time_s"] = statistics.median(times[k])
                rows[k]["peak_bytes"] = gpu.peak_bytes(lambda m=m: step(m, idx), device)
        except torch.cuda.OutOfMemoryError:
            for r in rows.values():
                r.setdefault("status", "out of memory")
        except Exception as e:  # noqa: BLE001 - record, try the next context
            for r in rows.values():
                r.setdefault("status", f"failed: {describe(e)}")
        for m in models.values():
            m.zero_grad(set_to_none=True)
        gpu.empty_cache(device)
        for r in rows.values():
            rec.add(r)
