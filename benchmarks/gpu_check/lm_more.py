"""Parts of the GPU check on language models beyond the training step:

- ``lm_linearized``: a linearized model's generation step. A random Llama-style ``decoder_base`` is
  linearized with 0 steps (:func:`whiteformer.convert.linearize`: the plain swap, a
  ``tost_decoder_base`` whose TSSA layers start from the teacher's value / output projections);
  a prompt of 1k tokens is prefilled, then ``step`` is timed per token, float32. The last step's
  logits must equal the parallel forward's last logits over the whole sequence (relative error),
  and the state's size is recorded after the prompt and after the steps (constant for TSSA).
- ``lm_packed``: the forward of a causal ToST language model on one packed row of 1,000 documents
  (``cu_seqlens``, random lengths), bfloat16 autocast: median time, tokens per second, and two
  documents' logits against each run alone.
"""
from __future__ import annotations

import contextlib
import statistics
from typing import Any, Dict

import torch

from .. import gpu
from .record import describe

LINEARIZED = {"full": dict(model=dict(vocab_size=4096, dim=512, depth=8, num_heads=8, num_kv_heads=4,
                                      intermediate_size=1376), prompt=1024, steps=64),
              "dry": dict(model=dict(vocab_size=64, dim=32, depth=2, num_heads=4, num_kv_heads=2,
                                     intermediate_size=64), prompt=16, steps=3)}
PACKED = {"full": dict(model=dict(vocab_size=32000, dim=768, depth=12, num_heads=12), documents=1000,
                       min_len=16, max_len=112, repeats=5),
          "dry": dict(model=dict(vocab_size=64, dim=32, depth=2, num_heads=4), documents=12, min_len=2, max_len=6,
                      repeats=1)}


def _state_bytes(state) -> int:
    from ..common import tensor_bytes

    return tensor_bytes(state.layers)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def run_lm_linearized(cfg: Dict[str, Any], rec) -> None:
    import whiteformer
    from whiteformer.convert import linearize

    device = cfg["device"]
    plan = LINEARIZED["dry" if cfg["dry_run"] else "full"]
    rec.set(model_args=plan["model"], prompt=plan["prompt"], steps=plan["steps"], dtype="float32")
    torch.manual_seed(0)
    teacher = whiteformer.create_model("decoder_base", **plan["model"]).to(device).eval()
    gen = torch.Generator().manual_seed(0)
    seq = torch.randint(0, plan["model"]["vocab_size"], (1, plan["prompt"] + plan["steps"]), generator=gen).to(device)
    student, _ = linearize(teacher, [seq], transfer_steps=0, finetune_steps=0, progress=False)
    del teacher
    prompt = seq[:, :plan["prompt"]]
    with gpu.backend("triton"), torch.no_grad():
        prefill_s = gpu.cuda_time(lambda: student.prefill(prompt), device)
        _, state = student.prefill(prompt)
        after_prompt = _state_bytes(state)
        times = []
        logits = None
        for t in range(plan["prompt"], seq.shape[1]):
            def one(t=t):
                nonlocal logits, state
                logits, state = student.step(seq[:, t], state)
            times.append(gpu.cuda_time(one, device))
        full, _ = student(seq)
    err = _rel_err(logits, full[:, -1])
    tol = 1e-3 if device.startswith("cuda") else 1e-4  # (Triton's float32 dots may round through TF32)
    rec.add({"model": "tost_decoder_base (linearized, 0 steps)", "prefill_s": prefill_s,
             "step_s_median": statistics.median(times), "step_s_first": times[0],
             "state_bytes_after_prompt": after_prompt, "state_bytes_after_steps": _state_bytes(state),
             "rel_err_step_vs_forward": err, "tol": tol, "passed": err <= tol})


def _lengths(plan: Dict[str, Any], gen: torch.Generator) -> torch.Tensor:
    return torch.randint(plan["min_len"], plan["max_len"] + 1, (plan["documents"],), generator=gen)


def run_lm_packed(cfg: Dict[str, Any], rec) -> None:
    import whiteformer

    device = cfg["device"]
    plan = PACKED["dry" if cfg["dry_run"] else "full"]
    gen = torch.Generator().manual_seed(0)
    lengths = _lengths(plan, gen)
    total = int(lengths.sum())
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    rec.set(model="tost_lm_base", model_args=plan["model"], documents=plan["documents"], tokens=total,
            autocast="bfloat16" if device.startswith("cuda") else None)
    torch.manual_seed(0)
    model = whiteformer.create_model("tost_lm_base", pos_emb=False, pos_bias=False, **plan["model"]).to(device).eval()
    idx = torch.randint(0, plan["model"]["vocab_size"], (1, total), generator=gen).to(device)
    cu = cu.to(device)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda")
                else contextlib.nullcontext())

    def forward(x, cu_seqlens=None):
        with gpu.backend("triton"), autocast, torch.no_grad():
            return model(x, cu_seqlens=cu_seqlens)[0]

    row: Dict[str, Any] = {"documents": plan["documents"], "tokens": total}
    try:
        packed = forward(idx, cu)  # warm-up (compiles the kernels), and the logits checked below
        times = [gpu.cuda_time(lambda: forward(idx, cu), device) for _ in range(plan["repeats"])]
        row.update(time_s=statistics.median(times), tokens_per_s=total / statistics.median(times))
        errs = []
        for k in (0, plan["documents"] // 2):  # a document alone gives its rows of the packed logits
            a, b = int(cu[k]), int(cu[k + 1])
            errs.append(_rel_err(packed[:, a:b].float(), forward(idx[:, a:b]).float()))
        tol = 2e-2 if device.startswith("cuda") else 1e-4  # bfloat16 autocast on a GPU
        row.update(rel_err_document_vs_alone=max(errs), tol=tol, passed=max(errs) <= tol)
    except torch.cuda.OutOfMemoryError:
        row["status"] = "out of memory"
    except Exception as e:  # noqa: BLE001 - record it in the row
        row["status"] = f"failed: {describe(e)}"
    rec.add(row)
