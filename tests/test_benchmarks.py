"""Smoke tests of the benchmark suite (benchmarks/ at the repository root): each benchmark runs in a
tiny configuration and writes its outputs, so that the suite does not rot. No timing assertions."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import (  # noqa: E402
    attention_scaling,
    attention_target,
    common,
    compressed_attention,
    generation,
    report,  # noqa: E402
)
from benchmarks import run as bench_run  # noqa: E402

TINY_ATTN = dict(tokens=[256, 512], dims=[192], dim_sweep_tokens=256, dim_modes=["fwd"], depth=1, repeats=1,
                 budget_per_config=0.5, long_run=0.5, target_tokens=512)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The three benchmarks in tiny configurations, written to one directory."""
    out = tmp_path_factory.mktemp("bench")
    return dict(
        out=out,
        attention=attention_scaling.run(quick=True, out_dir=out, overrides=TINY_ATTN, sweeps=["tokens"],
                                        command="pytest"),
        generation=generation.run(quick=True, out_dir=out, prefill="real", command="pytest"),
        compression=compressed_attention.run(quick=True, out_dir=out, command="pytest"),
        target=attention_target.run(n=256, depth=1, rounds=2, out=out / "attention_target_quick.json",
                                    command="pytest"),
    )


def test_every_method_builds_and_keeps_shape():
    x = torch.randn(1, 256, 192)
    for method in attention_scaling.METHODS:
        stack = attention_scaling.build_stack(method, 192, 8, 2).eval()
        with torch.no_grad():
            y = stack(x)
        assert y.shape == x.shape and torch.isfinite(y).all(), method
    with pytest.raises(ValueError, match="unknown method"):
        attention_scaling.build_stack("nope", 192, 8, 1)


def test_mhsa_variants_use_their_paths():
    assert attention_scaling.build_layer("mhsa_sdpa", 64, 4).fused_attn is True
    assert attention_scaling.build_layer("mhsa_explicit", 64, 4).fused_attn is False


def test_attention_scaling_tiny(tiny, tmp_path):
    res = tiny["attention"]
    rows = res["rows"]
    # every method x 2 sizes x 2 modes, each in its own child process
    assert len(rows) == len(attention_scaling.METHODS) * 4
    bad = [(r["method"], r["n"], r["mode"], r["status"]) for r in rows if r["status"] != "ok"]
    assert not bad, bad
    for r in rows:
        assert r["time_s"] > 0 and r["runs"] >= 1 and r["peak_mem_bytes"] >= 0
        assert r["env"]["torch"] == torch.__version__ and r["env"]["command"] == "pytest"
    # the target row carries a side-by-side TSSA measurement
    assert res["target"]["speedup"] is not None and "side_by_side" in res["target"]
    saved = json.loads((tiny["out"] / "attention_scaling_quick.json").read_text())
    assert len(saved["rows"]) == len(rows)
    assert "| TSSA (ToST)" in (tiny["out"] / "attention_scaling_quick.md").read_text()
    assert (tiny["out"] / "attention_scaling_tokens_quick.png").stat().st_size > 0
    # width sweep (forward only by default in the full run)
    res = attention_scaling.run(quick=True, out_dir=tmp_path, methods=["tssa", "eca_nochol"], sweeps=["dim"],
                                overrides=TINY_ATTN)
    assert [(r["method"], r["dim"], r["n"], r["status"]) for r in res["rows"]] == [
        ("tssa", 192, 256, "ok"), ("eca_nochol", 192, 256, "ok")]
    assert (tmp_path / "attention_scaling_dim_quick.png").stat().st_size > 0


def test_budget_skips_are_recorded(tmp_path):
    # a 1 ms budget: the first size runs, the next ones are skipped from the estimate
    over = dict(TINY_ATTN, tokens=[256, 512, 1024], time_budget=1e-3, time_budget_fwdbwd=1e-3)
    rows = attention_scaling.run(quick=True, out_dir=tmp_path, methods=["tssa"], sweeps=["tokens"], overrides=over,
                                 write=False)["rows"]
    status = {(r["n"], r["mode"]): r["status"] for r in rows}
    assert status[(256, "fwd")] == "ok"
    assert status[(512, "fwd")] == status[(1024, "fwd")] == "skipped (budget)"
    over = dict(TINY_ATTN, tokens=[256, 512], mem_budget=1)
    rows = attention_scaling.run(quick=True, out_dir=tmp_path, methods=["mhsa_explicit"], sweeps=["tokens"],
                                 overrides=over, write=False)["rows"]
    assert {r["status"] for r in rows if r["n"] == 512} == {"skipped (memory)"}


def _check_generation(res, prefill):
    rows = res["rows"]
    assert {(r["model"], r["position"]) for r in rows} == {(m, p) for m in ("tost", "gpt") for p in (64, 256)}
    by = {(r["model"], r["position"]): r for r in rows}
    # ToST's state does not grow; GPT's KV cache grows linearly with the position
    assert by[("tost", 64)]["state_bytes"] == by[("tost", 256)]["state_bytes"]
    assert by[("gpt", 256)]["state_bytes"] == 4 * by[("gpt", 64)]["state_bytes"]
    assert all(r["per_token_s"] > 0 and r["prefill"] == prefill and r["steps"] >= 1 for r in rows)
    s = res["summary"]["tiny"]
    assert math.isfinite(s["tost_ratio_last_first"]) and set(s["gpt_over_tost"]) == {"64", "256"}


def test_allocator_keep_option(tmp_path):
    over = dict(TINY_ATTN, tokens=[256], allocator="keep")
    rows = attention_scaling.run(quick=True, methods=["tssa"], sweeps=["tokens"], overrides=over, write=False)["rows"]
    assert [r["status"] for r in rows] == ["ok", "ok"]


def test_merge_replaces_only_the_given_methods(tmp_path):
    over = dict(TINY_ATTN, tokens=[256])
    first = attention_scaling.run(quick=True, out_dir=tmp_path, methods=["tssa", "xca"], sweeps=["tokens"],
                                  overrides=over, command="first")
    kept = [r for r in first["rows"] if r["method"] == "tssa"]
    attention_scaling.run(quick=True, out_dir=tmp_path, methods=["xca"], sweeps=["tokens"], overrides=over,
                          command="second", merge=True)
    saved = json.loads((tmp_path / "attention_scaling_quick.json").read_text())
    assert [r for r in saved["rows"] if r["method"] == "tssa"] == kept
    xca = [r for r in saved["rows"] if r["method"] == "xca"]
    assert xca and all(r["env"]["command"] == "second" for r in xca)
    assert [m["command"] for m in saved["merged"]] == ["second"] and saved["command"] == "first"
    with pytest.raises(FileNotFoundError, match="--merge"):
        attention_scaling.run(quick=True, out_dir=tmp_path / "none", methods=["xca"], sweeps=["tokens"],
                              overrides=over, merge=True)


def test_generation_tiny(tiny):
    _check_generation(tiny["generation"], "real")
    assert (tiny["out"] / "generation_quick.png").stat().st_size > 0
    assert "per-token time" in (tiny["out"] / "generation_quick.md").read_text()
    _check_generation(generation.run(quick=True, prefill="extend", write=False), "extend")


def test_extend_state_matches_prefill_shapes():
    cfg = generation.QUICK["extra_configs"]["tiny"]
    for kind in ("tost", "gpt"):
        model = generation.build_model(kind, cfg, "cpu")
        idx = torch.randint(0, cfg["vocab_size"], (1, 24))
        with torch.no_grad():
            real = generation._prefill_state(model, idx)
            ext = generation.extend_state(kind, generation._prefill_state(model, idx[:, :8]), 24)
            assert ext.pos == real.pos == 24
            for a, b in zip(ext.layers, real.layers):
                for u, v in zip(a, b):
                    if isinstance(u, torch.Tensor):
                        assert u.shape == v.shape
                    else:
                        assert u == v
            logits, _ = model.step(idx[:, -1], ext)
            assert torch.isfinite(logits).all()


def test_compressed_attention_tiny(tiny):
    assert compressed_attention.available()
    rows = tiny["compression"]["rows"]
    layers = {r["layer"] for r in rows}
    assert layers == {"mhsa", "truncatt", "cp_slimatt", "irratt_general", "irratt_identity"}
    for r in rows:
        assert r["time_s"] > 0
        if r["layer"] != "mhsa":  # ranks chosen within the QK FLOPs budget
            assert r["qk_macs_ratio"] <= r["target_qk_ratio"] + 1e-9
    assert (tiny["out"] / "compressed_attention_quick.md").stat().st_size > 0


def test_report_renders_every_section(tiny):
    page = report.render(tiny["out"], "_quick")
    for heading in ("## 1. Attention scaling", "### Target", "### Where the time goes", "## 2. Causal generation",
                    "## 3. Compressed attention", "## 4. Fused TSSA kernel", "## 5. GPU: Triton kernels", "## Caveats"):
        assert heading in page, heading
    assert "attention_scaling_tokens_quick.png" in page and "| TSSA (ToST)" in page


def test_attention_target_tiny(tiny):
    res = json.loads((tiny["out"] / "attention_target_quick.json").read_text())
    assert [r["allocator"] for r in res["runs"]] == ["default", "keep"]
    for r in res["runs"]:
        assert len(r["tssa_samples_s"]) == len(r["mhsa_sdpa_samples_s"]) == len(r["ratios"]) == 2
        assert r["speedup"] > 0 and isinstance(r["met"], bool)
    assert res["mac_ratio"] == pytest.approx(2 + 256 / 384)
    page = report.render(tiny["out"], "_quick")
    assert "Dedicated run, n = 256, allocator `keep`" in page
    with pytest.raises(SystemExit, match="divisible"):
        attention_target.main(["--dim", "100", "--heads", "8"])


def test_irregular_ranks():
    r = compressed_attention.irregular_ranks(30, 4)
    assert sum(r) == 30 and min(r) >= 1 and r == sorted(r, reverse=True) and len(set(r)) > 1
    with pytest.raises(ValueError, match="total rank"):
        compressed_attention.irregular_ranks(3, 4)


def test_peak_memory_sees_an_allocation():
    with common.PeakMemory("cpu") as pm:
        t = torch.ones(64 * 2 ** 20 // 4)  # 64 MiB, touched
        del t
    assert pm.delta >= 32 * 2 ** 20, (pm.delta, pm.method)


def test_run_isolated_reports_child_errors():
    with pytest.raises(common.ChildFailed, match="unknown method"):
        common.run_isolated(attention_scaling.build_stack, "nope", 8, 2, 1, timeout=120)


def test_runner_cli_parses_and_dispatches(tmp_path, monkeypatch):
    calls = []
    for mod, name in ((attention_scaling, "attention"), (generation, "generation"),
                      (compressed_attention, "compression")):
        monkeypatch.setattr(mod, "run", lambda name=name, **kw: calls.append((name, kw["quick"])) or {})
    monkeypatch.setattr(attention_target, "run", lambda **kw: calls.append(("target", kw["n"] == 1024)) or {})
    from benchmarks import compressed_latency, irratt_decomposition

    monkeypatch.setattr(compressed_latency, "run", lambda **kw: calls.append(("latency", kw["quick"])) or {})
    monkeypatch.setattr(irratt_decomposition, "run",
                        lambda **kw: calls.append(("irratt", kw["quick"], kw["threads"])) or {})
    monkeypatch.setattr(bench_run, "_run_fused", lambda quick, out: calls.append(("fused", quick)) or {})
    out = bench_run.main(["all", "--quick", "--out", str(tmp_path), "--threads", "1"])
    assert calls == [("attention", True), ("target", True), ("generation", True), ("compression", True),
                     ("latency", True), ("irratt", True, 1), ("fused", True)]
    assert set(out) == {"attention", "target", "generation", "compression", "latency", "irratt", "fused"}
    with pytest.raises(SystemExit):
        bench_run.main(["nonsense"])


def test_lm_model_tiny(tmp_path):
    from benchmarks import lm_model

    ov = dict(contexts=[32], modes=["train"], losses=["plain", "chunked"], loss_chunk=8, profile_context=16)
    res = lm_model.run(quick=True, out_dir=tmp_path, overrides=ov, threads=1, command="pytest")
    rows = res["rows"]
    times = {(r["model"], r["loss"]) for r in rows if r["kind"] == "time" and "time_s" in r}
    mems = {(r["model"], r["loss"]) for r in rows if r["kind"] == "memory"}
    assert times == mems == {(k, loss) for k in lm_model.MODELS for loss in ("plain", "chunked")}
    d = res["summary"]["train/plain/32/tost_over_gpt_sdpa"]
    assert d["time_ratio"] > 0 and d["memory_ratio"] > 0
    assert {r["part"] for r in rows if r["kind"] == "profile"} >= {"attention", "mlp", "lm_head+loss (chunked)"}
    md = (tmp_path / "lm_model_quick.md").read_text()
    assert "ToST / GPT-SDPA time, mem." in md and "Where a training step's time goes" in md
    page = "\n".join(report.lm_model_section(res))
    assert "0.60x time and 0.41x memory" in page and "Not measured here: context 4k, 8k" in page
    # explicit-softmax cells above the memory budget are skipped and recorded
    assert lm_model.softmax_scores_bytes("gpt_softmax", lm_model.CONFIGS["base"], 8192, "train") > 6 * common.GiB
    res2 = lm_model.run(quick=True, overrides=dict(ov, losses=["plain"], mem_budget_gib=1e-9, profile_context=0),
                        threads=1, write=False)
    assert any(r.get("skipped") and r["model"] == "gpt_softmax" for r in res2["rows"])


def test_grad_checkpointing_tiny(tmp_path):
    from benchmarks import grad_checkpointing

    res = grad_checkpointing.run(quick=True, out_dir=tmp_path, overrides=dict(contexts=[32], models=["tost"]),
                                 threads=1, command="pytest")
    assert {(r["model"], r["checkpointing"]) for r in res["rows"]} == {("tost", False), ("tost", True)}
    assert all(r["peak_bytes"] >= 0 and r["time_s"] > 0 for r in res["rows"])
    md = (tmp_path / "grad_checkpointing_quick.md").read_text()
    assert "peak mem. with checkpointing" in md
    page = "\n".join(report.grad_checkpointing_section(res))
    assert "## Activation checkpointing" in page and "pytest" in page


def test_context_parallel_bytes_are_flat_in_the_length():
    """Measured over 2 gloo processes: the bytes a TSSA layer sends do not grow with N; ring
    attention's formula does."""
    from benchmarks import context_parallel as cp

    rows = cp.measure_bytes([8, 32], threads=1)
    for layer in ("tssa", "causal_tssa"):
        sent = [(r["forward_wire"], r["backward_wire"]) for r in rows if r["layer"] == layer]
        assert len(sent) == 2 and sent[0] == sent[1] and min(sent[0]) > 0, (layer, sent)
    ring = [r["ring_attention"]["forward"] for r in rows if r["layer"] == "tssa"]
    assert ring[1] == 4 * ring[0]
    assert "has not written" in "\n".join(cp.section(None))


def test_results_are_written_whole_and_never_through_a_link(tmp_path):
    """The result files (JSON, markdown, figures) were written with ``open(path, "w")``: through a
    link in benchmarks/results into its target, and half-written when the run was killed."""
    target = tmp_path / "elsewhere.json"
    target.write_text("theirs")
    out = tmp_path / "results"
    out.mkdir()
    (out / "gpu.json").symlink_to(target)
    (out / "gpu.md").symlink_to(target)
    common.write_json(out / "gpu.json", {"a": 1})
    common.write_text(out / "gpu.md", "| a |")
    assert target.read_text() == "theirs"
    assert json.loads((out / "gpu.json").read_text()) == {"a": 1} and (out / "gpu.md").read_text() == "| a |"
    assert sorted(p.name for p in out.iterdir()) == ["gpu.json", "gpu.md"]


def test_op_floor_tiny(tmp_path):
    from benchmarks import op_floor

    path = tmp_path / "op_floor_quick.json"
    threads = torch.get_num_threads()
    op_floor.main(["--quick", "--threads", "1", "--allocator", "default", "--out", str(path)])  # keep: below
    assert torch.get_num_threads() == threads  # the process's setting is restored
    res = json.loads(path.read_text())
    assert {"torch", "loadavg", "loadavg_end", "command", "config", "rows"} <= set(res)
    assert res["config"]["rounds"] >= 1
    ops = {(r["op"], r["n"]) for r in res["rows"]}
    sizes = {s[2] for s in op_floor.QUICK_SIZES}
    assert ops == ({(op, n) for op in ("tssa_fwd", "causal_fwd", "overflow_guard") for n in sizes}
                   | {(op, max(sizes)) for op in ("tssa_fwdbwd", "causal_fwdbwd")})
    for r in res["rows"]:
        assert {"target", "met", "threads", "batch", "loadavg"} <= set(r)
        value = r["share_of_fwd"] if r["op"] == "overflow_guard" else r["ratio"]
        assert math.isfinite(value) and (value > 0 or r["op"] == "overflow_guard" and value == 0)
        if r["op"] != "overflow_guard":
            assert r["met"] is None and r["target"] is None  # no target at tiny sizes
    assert "| overflow guard |" in op_floor.table(res)
    if op_floor.path_of(torch.randn(1, 2, 4, 8))["kernel"] == "C++ fused":  # the bare kernel beside each forward
        fwd = [r for r in res["rows"] if r["op"] in ("tssa_fwd", "causal_fwd")]
        assert fwd and all(r["kernel_ratio"] > 0 and math.isfinite(r["call_overhead_us"]) for r in fwd)
    page = "\n".join(report.op_floor_section(tmp_path, "_quick"))
    assert "### TSSA against its traffic floor" in page and "| tssa_fwd |" in page
    assert "has not written" in "\n".join(report.op_floor_section(tmp_path / "none"))


def test_op_floor_both_allocators(tmp_path):
    """--allocator both (in a process of its own: keep raises glibc's thresholds for good) measures
    every row under each setting, default first, and tags the rows."""
    from benchmarks import op_floor

    path = tmp_path / "op_floor_quick.json"
    subprocess.run([sys.executable, "-m", "benchmarks.op_floor", "--quick", "--threads", "1", "--out", str(path)],
                   check=True, cwd=ROOT, capture_output=True, timeout=600)
    res = json.loads(path.read_text())
    assert res["config"]["allocators"] == ["default", "keep"]
    tags = [r["allocator"] for r in res["rows"]]
    assert tags == sorted(tags) and tags.count("default") == tags.count("keep") > 0  # default rows first
    assert "| keep |" in op_floor.table(res)


def test_op_floor_targets_and_profile():
    from benchmarks import op_floor

    assert op_floor.target_for("tssa_fwd", 4, 1024, 1)[0] == 2.5
    assert op_floor.target_for("tssa_fwd", 4, 1024, 2) is None
    assert op_floor.target_for("causal_fwdbwd", 1, 16384, 2)[0] == 4.0
    w = torch.randn(1, 2, 32, 4)
    top = op_floor.top_ops(lambda: (w * 2).sum())
    assert 1 <= len(top) <= 3 and all(t["self_cpu_us"] >= 0 and 0 <= t["share"] <= 1 for t in top)
    # a row past its target carries the profile of its call; one within it does not
    missed = op_floor._row("tssa_fwd", (1, 8, 16384, 48), 1, {"ratio": 9.0}, lambda: (w * 2).sum())
    kept = op_floor._row("tssa_fwd", (1, 8, 16384, 48), 1, {"ratio": 1.0}, lambda: (w * 2).sum())
    assert missed["met"] is False and missed["profile_top3"] and kept["met"] is True and "profile_top3" not in kept
    # the figures the docs' reading quotes come from the same rows
    vals = op_floor.reading_values({"rows": [
        {"op": "tssa_fwd", "n": 256, "batch": 4, "threads": 1, "clone_s": 3e-5, "call_overhead_us": 40.0,
         "profile_top3": [{"op": "tssa_fwd: out (read w, write out)", "share": 0.4}]},
        {"op": "tssa_fwd", "n": 1024, "batch": 4, "threads": 1, "clone_s": 1e-4, "call_overhead_us": 90.0,
         "kernel_ratio": 3.0}]})
    assert vals["small_n"] == "256" and vals["overhead_small"] == "40 µs" and vals["clone_small"] == "30 µs"
    assert vals["out_share"] == "40 %" and vals["kernel_1k"] == "3.00x" and vals["middle_share"] == "n/a"
    # a clone that page-faults makes a ratio read better than the op is: that row is not judged
    op_floor._set_clone_faults(kept, 2048.0, lambda: (w * 2).sum())
    assert kept["met"] is None and "2048" in kept["not_judged"] and kept["profile_top3"]
    assert op_floor._fmt_met(kept) == "n/a (clone faulted)"
    op_floor._set_clone_faults(missed, 0.0, lambda: (w * 2).sum())
    assert missed["met"] is False and "not_judged" not in missed


def test_packed_lm_row_tiny():
    """The packed language-model row: a forward's host reads do not grow with the depth, and the
    section reports each library's."""
    from benchmarks.packed_varlen import lm_cell, lm_section

    rows = {depth: common.run_isolated(lm_cell, "tost_lm_base", 30, depth, 16, 2, timeout=300)  # its own process
            for depth in (1, 3)}
    assert rows[1]["host_reads"] == rows[3]["host_reads"] > 0 and rows[1]["time_s"] > 0
    page = "\n".join(lm_section({"runs": {"here": [rows[3]]}, "machine": common.machine_info("cpu"),
                                 "commands": {"here": "pytest"}}))
    assert f"here: {rows[3]['host_reads']}" in page and "| here | tost_lm_base | 3 | 30 |" in page
    assert "Not run yet" in "\n".join(lm_section(None))
