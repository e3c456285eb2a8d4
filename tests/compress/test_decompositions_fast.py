"""Fast paths of the decompositions against their plain references: CP-ALS / CPD-EPC
(:mod:`whiteformer.compress.cp_fast` vs :mod:`~whiteformer.compress.cp_reference`), the EPC multiplier
search, the stacked MTTKRPs and the BTD-(L, L, 1) refinement; and the progress of ``compress``."""
import io
import math

import pytest
import torch

from test_decompositions import planted_btd  # the planted BTD tensor of the reference tests
from whiteformer.compress import HeadFactors, Whitening, btd_ll1, compress, cp
from whiteformer.compress._tensor import StackedSlices, mttkrp
from whiteformer.compress.cp import correct_cp
from whiteformer.compress.cp_fast import grid_lambda
from whiteformer.compress.cp_reference import bisect_lambda
from whiteformer.compress.progress import BlockProgress
from whiteformer.models import create_model

DT = torch.float64


def random_factors(H=3, I=17, J=16, p=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return HeadFactors(torch.randn(H, I, p, generator=g, dtype=DT), torch.randn(H, J, p, generator=g, dtype=DT))


def rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("dense", [False, True])
def test_stacked_mttkrps_equal_the_reference(dense):
    Y = random_factors(H=4, I=11, J=9, p=3, seed=1)
    Y = Y.to_tensor() if dense else Y
    g = torch.Generator().manual_seed(2)
    A, B, C = (torch.randn(n, 6, generator=g, dtype=DT) for n in (11, 9, 4))
    op = StackedSlices(Y)
    PA, KB = op.project_p(A), op.project_k(B)
    for mode, got in ((0, op.mttkrp0(KB, C)), (1, op.mttkrp1(PA, C)), (2, op.mttkrp2(PA, KB))):
        torch.testing.assert_close(got, mttkrp(Y, (A, B, C), mode), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("kw", [dict(epc=False, n_iter_max=60), dict(epc=True, n_iter_max=30, epc_iter_max=20),
                                dict(epc=True, n_iter_max=7, epc_iter_max=5),
                                dict(epc=True, init="random", tol=1e-4, epc_tol=1e-4)])
def test_cp_fast_follows_the_reference_iterates(dense, kw):
    Y = random_factors(H=4, I=14, J=13, p=3, seed=3)
    Y = Y.to_tensor() if dense else Y
    ref = cp(Y, 9, impl="reference", **kw)
    fast = cp(Y, 9, **kw)
    assert fast.n_iter == ref.n_iter
    assert fast.als_rel_error == pytest.approx(ref.als_rel_error, rel=1e-9)
    assert fast.rel_error == pytest.approx(ref.rel_error, rel=1e-9)
    assert fast.sensitivity == pytest.approx(ref.sensitivity, rel=1e-7)
    torch.testing.assert_close(fast.to_tensor(), ref.to_tensor(), rtol=1e-7, atol=1e-9)
    Yd = Y if dense else Y.to_tensor()
    assert fast.rel_error == pytest.approx(rel(fast.to_tensor(), Yd), rel=1e-8)


def test_cp_fast_at_a_realistic_size_and_activation_aware():
    """A DeiT-T-like query-key tensor (F 192 + bias row, H 3, p 64) at rank 92, whitened."""
    g = torch.Generator().manual_seed(4)
    Y = HeadFactors(0.02 * torch.randn(3, 193, 64, generator=g, dtype=DT), 0.02 * torch.randn(3, 192, 64, generator=g,
                                                                                          dtype=DT))
    X = torch.randn(300, 192, generator=g, dtype=DT)
    wh = Whitening.from_calibration(X, Y.shape)
    ref = cp(Y, 92, n_iter_max=12, epc_iter_max=4, calib=wh, impl="reference")
    fast = cp(Y, 92, n_iter_max=12, epc_iter_max=4, calib=wh)
    assert fast.n_iter == ref.n_iter == 12
    assert fast.rel_error == pytest.approx(ref.rel_error, rel=1e-8)
    torch.testing.assert_close(fast.to_tensor(), ref.to_tensor(), rtol=1e-6, atol=1e-10)


def test_grid_lambda_finds_the_bisection_multiplier():
    g = torch.Generator().manual_seed(5)
    for trial in range(30):
        R = 1 + trial % 17
        s = torch.rand(R, generator=g, dtype=DT) * 10.0 ** float(torch.randint(-6, 7, (1,), generator=g))
        s[torch.rand(R, generator=g) < 0.2] = 0.0
        z2 = torch.rand(R, generator=g, dtype=DT) * 10.0 ** float(torch.randint(-3, 4, (1,), generator=g))
        floor = 1e-12 * float(s.max().clamp_min(1e-300))
        normY2 = float(z2.sum()) * (1.0 + float(torch.rand(1, generator=g)))
        lo_err = normY2 - float(z2[s > floor].sum())  # the least-squares error
        delta2 = lo_err + (normY2 - lo_err) * float(torch.rand(1, generator=g))
        want, got = bisect_lambda(s, z2, floor, normY2, delta2), grid_lambda(s, z2, floor, normY2, delta2)
        assert got == pytest.approx(want, rel=1e-9, abs=1e-300), (trial, want, got)


def test_grid_lambda_least_squares_and_far_multipliers():
    s = torch.tensor([3.0, 1.0, 0.0], dtype=DT)
    z2 = torch.tensor([1.0, 2.0, 0.5], dtype=DT)
    floor = 3e-12
    assert grid_lambda(s, z2, floor, 10.0, 10.0 - 3.0) == 0.0 == bisect_lambda(s, z2, floor, 10.0, 7.0)
    for delta2 in (10.0 - 1e-30, 7.0 + 1e-25):  # lam very large / very small
        assert grid_lambda(s, z2, floor, 10.0, delta2) == pytest.approx(bisect_lambda(s, z2, floor, 10.0, delta2),
                                                                       rel=1e-9)


def test_btd_fast_recovers_planted_blocks():
    ranks = (1, 2, 4, 3)
    Y = planted_btd(ranks)
    res = btd_ll1(Y, sum(ranks), cp_kwargs=dict(n_iter_max=500, tol=1e-13), tol=1e-12, n_iter_max=300)
    assert res.ranks == ranks and res.rel_error < 1e-6
    assert rel(res.to_tensor(), Y) == pytest.approx(res.rel_error, abs=1e-8)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_btd_fast_error_no_worse_than_reference_at_a_head_size(seed):
    """H 4 heads of dim p 16 (F 64, one bias row), total rank 24: the fast path (early-stopped CP,
    warm single refits, tighter sweep tolerance, two starts) reaches the reference's error (within
    0.1 %), and each of its starts alone does no better than both."""
    g = torch.Generator().manual_seed(seed)
    Y = HeadFactors(torch.randn(4, 65, 16, generator=g, dtype=DT), torch.randn(4, 64, 16, generator=g, dtype=DT))
    ref = btd_ll1(Y, 24, max_rank=16, impl="reference")
    fast = btd_ll1(Y, 24, max_rank=16)
    assert fast.rel_error <= ref.rel_error * 1.001
    assert sum(fast.ranks) == 24 and max(fast.ranks) <= 16
    als_only = btd_ll1(Y, 24, max_rank=16, cp_kwargs=dict(epc=False))
    epc_only = btd_ll1(Y, cp_result=cp(Y, 24, tol=1e-3, epc_tol=3e-3), max_rank=16)
    assert not als_only.cp_result.epc and epc_only.cp_result.epc
    assert fast.rel_error <= min(als_only.rel_error, epc_only.rel_error) * (1 + 1e-5)
    hist = fast.history
    assert all(b <= a + 1e-12 for a, b in zip(hist, hist[1:]))
    # the tracked error is the error of the returned blocks
    assert fast.rel_error == pytest.approx(rel(fast.to_tensor(), Y.to_tensor()), rel=1e-9)


@pytest.mark.parametrize("activation_aware", [False, True])
def test_correct_cp_is_cp_in_two_steps(activation_aware):
    """cp(Y, R) == correct_cp(Y, cp(Y, R, epc=False)): the ALS model, then its EPC correction."""
    Y = random_factors()
    calib = torch.randn(50, Y.shape[0] - 1, generator=torch.Generator().manual_seed(3), dtype=DT) \
        if activation_aware else None
    whole = cp(Y, 6, calib=calib, epc_iter_max=20)
    als = cp(Y, 6, calib=calib, epc=False)
    two = correct_cp(Y, als, calib=calib, n_iter_max=20)
    assert not als.epc and two.epc and two.n_iter == whole.n_iter
    for got, want in ((two.A, whole.A), (two.B, whole.B), (two.C, whole.C)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert two.rel_error == pytest.approx(whole.rel_error, rel=1e-12)
    assert two.sensitivity == pytest.approx(whole.sensitivity, rel=1e-9)
    with pytest.raises(ValueError, match="epc=False"):
        correct_cp(Y, whole)


def test_btd_bad_impl():
    with pytest.raises(ValueError, match="impl"):
        btd_ll1(random_factors(), 4, impl="quick")
    with pytest.raises(ValueError, match="impl"):
        cp(random_factors(), 4, impl="quick")


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_lines_without_a_terminal_and_a_bar_on_one():
    out = io.StringIO()
    with BlockProgress(2, file=out) as bar:
        bar.update(0, "irratt", [5, 7], 12, 0.25, 1.5)
        bar.update(3, None, None, None, None, 0.1)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("compress: block 1/2 (index 0): irratt, QK ranks (per head) 5,7, total 12, "
                               "QK error 0.2500, 1.50 s; elapsed ")
    assert ", ETA " in lines[0] and lines[1].endswith("ETA 0.0 s")  # the last block: nothing left
    assert lines[1].startswith("compress: block 2/2 (index 3): QK exact") and len(lines) == 2
    tty = Tty()
    with BlockProgress(2, file=tty) as bar:
        assert bar.bar is not None
        bar.update(0, "irratt", [5, 7], 12, 0.25, 1.5)
    assert "block 0: QK ranks (per head) 5,7, total 12, QK error 0.2500" in tty.getvalue()
    assert "compress:" in tty.getvalue() and "1/2" in tty.getvalue()
    quiet = io.StringIO()
    BlockProgress(2, enabled=False, file=quiet).update(0, "irratt", [1], 1, 0.1, 0.1)
    assert quiet.getvalue() == ""


def test_compress_reports_progress_and_block_seconds(capsys):
    torch.manual_seed(0)
    model = create_model("deit_t_p16", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2,
                         num_classes=3)
    _, rep = compress(model, qk="irratt", qk_flops_ratio=0.5)
    err = capsys.readouterr().err.splitlines()
    assert [ln.split(":")[1].strip() for ln in err] == ["block 1/2 (index 0)", "block 2/2 (index 1)"]
    for line, row in zip(err, rep.blocks):
        assert f"QK error {row['qk_rel_error']:.4f}" in line and row["seconds"] > 0
        # the ranks as the report's per-block table prints them (per head), and their labelled total
        per_head = ",".join(str(r) for r in row["qk_ranks"])
        assert f"QK ranks (per head) {per_head}, total {row['qk_total_rank']}" in line
        assert f"| {per_head} |" in rep.to_markdown()
        assert math.isfinite(row["seconds"])
    compress(model, qk="irratt", qk_flops_ratio=0.5, progress=False)
    assert capsys.readouterr().err == ""
