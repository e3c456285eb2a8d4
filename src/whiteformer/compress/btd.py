"""BTD-(L, L, 1) decomposition initialised from CPD-EPC (IrrAtt paper, Algorithms 1-3).

``Y ~= sum_b (A_b B_b^T) o c_b`` with A_b (I x L_b), B_b (J x L_b), c_b in R^H: block b is a rank-L_b
matrix spread over the heads by the fusion column c_b. IrrAtt (Sec. 3.1, Eq. 6) uses one block per
head, so the block ranks L_b are the per-head QK ranks D_h.

* Algorithm 1 (:func:`btd_from_cp`): CP factors (A, B, C); normalise each column of C so that its
  largest-magnitude entry is 1 (the scale goes into A), assign each rank-1 term to the head holding
  that entry; the counts are the ranks D_h; set C = I.
* Algorithm 2 (:func:`fit_block`): fit one block to a residual tensor X': c = leading eigenvector of
  X'_(3) X'_(3)^T; repeat {rank-L truncated SVD of X' x_3 c = U S V^T; T = X'_(3) (V kr U), the
  H x L matrix T[h, l] = u_l^T X'_h v_l; best rank-1 T ~= s c d^T}; A = U diag(s d), B = V.
* Algorithm 3 (:func:`btd_ll1`): sweeps over the blocks, each refitted against
  X' = Y - sum_{k != b} block_k.

Because Algorithm 2 restarts c from the eigenvector, a refit can in rare cases be worse than the
current block; then the refit is redone warm-started from the current c (which cannot increase the
error) and kept only if it does not increase the error, so the error never increases.

The tensor is formed densely here (F x F x H, e.g. 7.1M numbers for DeiT-B): the residual updates
of Algorithm 3 would otherwise need sums of many low-rank terms. The rank-L SVD of Algorithm 2 is
exact for small slices and uses a randomised range finder with power iterations (fixed seed) when
L is small against F (e.g. F = 768); the acceptance test above keeps the error non-increasing either
way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

import torch

from .._checks import check_choice, check_instance, check_int
from ._tensor import TensorLike, as_float64, check_tensor_like, to_dense
from .cp import CPResult, correct_cp, cp
from .ranks import normalize_ranks
from .truncatt import allocate_ranks_spectral
from .whitening import Whitening

__all__ = ["BTDResult", "btd_ll1", "btd_from_cp", "fit_block", "assign_cp_terms"]

# Subspace iterations of the randomised SVD in each refit of the fast sweeps. With one, the refits
# are inexact and the sweeps stall above the reference's error; five make each SVD step close to
# exact at a small cost against the products with the residual.
_SWEEP_POWER_ITERS = 5


@dataclass
class BTDResult:
    """BTD-(L, L, 1) model ``Y ~= sum_b (A[b] @ B[b].T) o C[:, b]``.

    Attributes:
        A: list of tensors (I, L_b); B: list of (J, L_b); C: (H, n_blocks) head-fusion matrix
            (unit-norm columns after refinement; ``C = I`` straight after Algorithm 1).
        ranks: (L_1, ..., L_nblocks) (block b was initialised for head b; a rank may be 0).
        rel_error: ||Y - Yhat|| / ||Y|| (whitened metric when calibrated).
        init_rel_error: the same right after Algorithm 1.
        history: relative error after Algorithm 1 and after each sweep of Algorithm 3 (non-increasing).
    """

    A: List[torch.Tensor]
    B: List[torch.Tensor]
    C: torch.Tensor
    ranks: Tuple[int, ...]
    rel_error: float
    init_rel_error: float
    history: List[float] = field(default_factory=list)
    cp_result: Optional[CPResult] = field(default=None, repr=False)

    def to_tensor(self) -> torch.Tensor:
        """The approximation (I, J, H)."""
        I, J, H = self.A[0].shape[0], self.B[0].shape[0], self.C.shape[0]
        out = self.C.new_zeros(I, J, H)
        for b, (a, bb) in enumerate(zip(self.A, self.B)):
            if a.shape[1]:
                out = out + (a @ bb.T)[:, :, None] * self.C[:, b]
        return out


def assign_cp_terms(C: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 1's assignment: for each column r of C (H x R) the head of its largest-magnitude
    entry and that (signed) entry, so that ``C[:, r] / scale[r]`` has largest entry +1.

    Returns (head (R,) long, scale (R,))."""
    head = C.abs().argmax(dim=0)
    scale = C.gather(0, head[None, :])[0]
    return head, scale


def _block_tensor(a, b, c):
    return (a @ b.T)[:, :, None] * c


def btd_from_cp(cp_factors: Sequence[torch.Tensor]):
    """Algorithm 1: BTD blocks (A_h, B_h, e_h) and ranks from CP factors (A, B, C) (float64)."""
    A, B, C = cp_factors
    H = C.shape[0]
    head, scale = assign_cp_terms(C)
    A = A * scale
    blocks_a, blocks_b = [], []
    for h in range(H):
        idx = (head == h).nonzero().flatten()
        blocks_a.append(A[:, idx])
        blocks_b.append(B[:, idx])
    Cb = torch.eye(H, dtype=A.dtype, device=A.device)
    ranks = tuple(int(a.shape[1]) for a in blocks_a)
    return blocks_a, blocks_b, Cb, ranks


def _top_svd(M: torch.Tensor, rank: int, V0: Optional[torch.Tensor] = None, n_power: int = 3):
    """Leading ``rank`` singular vectors (U, V) of M: exact SVD for small problems, else a
    randomised range finder (Halko et al. 2011) with ``n_power`` subspace iterations, started from
    ``V0`` (J x L, e.g. the previous estimate) plus fixed-seed random columns."""
    m, n = M.shape
    k = min(rank + 10, m, n)
    if 3 * k >= min(m, n):
        u, _, vh = torch.linalg.svd(M, full_matrices=False)
        return u[:, :rank], vh[:rank].T
    g = torch.Generator().manual_seed(1234)
    omega = torch.randn(n, k, generator=g, dtype=M.dtype).to(M.device)
    if V0 is not None and V0.shape[1]:
        omega[:, :V0.shape[1]] = V0[:, :k]
    Q = torch.linalg.qr(M @ omega)[0]
    for _ in range(n_power):
        Q = torch.linalg.qr(M @ torch.linalg.qr(M.T @ Q)[0])[0]
    u, _, vh = torch.linalg.svd(Q.T @ M, full_matrices=False)
    return (Q @ u)[:, :rank], vh[:rank].T


def fit_block(X: torch.Tensor, rank: int, *, n_iter: int = 5, c0: Optional[torch.Tensor] = None,
              V0: Optional[torch.Tensor] = None):
    """Algorithm 2: best (A B^T) o c of rank ``rank`` for the dense residual X (I, J, H).

    ``c0`` warm-starts c (default: the leading eigenvector of X_(3) X_(3)^T, as the paper); ``V0``
    (J x L) warm-starts the randomised SVD used for large slices.
    Returns (A (I x L) = U diag(w), B (J x L) = V, c (H,) unit norm, error^2 = ||X||^2 - |w|^2);
    the error identity holds because U, V have orthonormal columns and c is the top left singular
    vector of T, so that w = T^T c.
    """
    if c0 is None:
        gram = torch.einsum("ijh,ijg->hg", X, X)
        c = torch.linalg.eigh(gram)[1][:, -1]
    else:
        c = c0 / c0.norm().clamp_min(1e-300)
    normX2 = float((X * X).sum())
    w = None
    U, V = None, V0
    for _ in range(max(1, n_iter)):
        U, V = _top_svd(torch.einsum("ijh,h->ij", X, c), rank, V)
        T = torch.einsum("jhl,jl->hl", torch.einsum("ijh,il->jhl", X, U), V)  # T[h, l] = u_l^T X_h v_l
        tu, ts, tvh = torch.linalg.svd(T, full_matrices=False)
        c = tu[:, 0]
        w = ts[0] * tvh[0]
    return U * w, V, c, normX2 - float((w * w).sum())


def _cap_and_respend(X: torch.Tensor, blocks_a, blocks_b, ranks, cap: int):
    """Cap Algorithm 1's blocks (C = I: block h lives in slice h) at rank ``cap`` and give the
    terms cut off to the blocks with the next-largest gains.

    A block above the cap keeps its best rank-``cap`` part (SVD). The freed terms go one by one to
    the head whose residual slice ``X_h - A_h B_h^T`` has the largest next singular value (the
    error drop of one more term there): the block gains the leading singular pairs of its
    residual, greedily over the heads (:func:`~.truncatt.allocate_ranks_spectral`). Returns
    (blocks_a, blocks_b, ranks) with ``sum(ranks)`` unchanged when the slices have room."""

    blocks_a, blocks_b = list(blocks_a), list(blocks_b)
    freed = 0
    for b, L in enumerate(ranks):
        if L > cap:
            u, sv, vh = torch.linalg.svd(blocks_a[b] @ blocks_b[b].T, full_matrices=False)
            blocks_a[b], blocks_b[b] = u[:, :cap] * sv[:cap], vh[:cap].T
            freed += L - cap
    ranks = tuple(min(L, cap) for L in ranks)
    if freed == 0:
        return blocks_a, blocks_b, ranks
    resid = [X[:, :, h] - blocks_a[h] @ blocks_b[h].T for h in range(len(ranks))]
    svds = [torch.linalg.svd(R, full_matrices=False) for R in resid]
    room = [cap - L for L in ranks]
    freed = min(freed, sum(room))
    extra = (0,) * len(ranks)
    if freed:
        extra = allocate_ranks_spectral([s[:r] for (_, s, _), r in zip(svds, room)], freed)
    for h, k in enumerate(extra):
        if k:
            u, sv, vh = svds[h]
            blocks_a[h] = torch.cat([blocks_a[h], u[:, :k] * sv[:k]], dim=1)
            blocks_b[h] = torch.cat([blocks_b[h], vh[:k].T], dim=1)
    return blocks_a, blocks_b, tuple(L + k for L, k in zip(ranks, extra))


def _rel(err2: float, normY2: float) -> float:
    return math.sqrt(max(err2, 0.0) / normY2) if normY2 > 0 else 0.0


def _sweeps_done(history: List[float], tol: float) -> bool:
    """Stop when a sweep improved the relative error by less than ``tol`` (relative)."""
    return history[-2] - history[-1] <= tol * max(history[-2], 1e-30)


def _residual(X, blocks_a, blocks_b, C, ranks):
    """X - sum_b (A_b B_b^T) o c_b, dense (I, J, H)."""
    resid = X.clone()
    for b, L in enumerate(ranks):
        if L:
            resid -= _block_tensor(blocks_a[b], blocks_b[b], C[:, b])
    return resid


def _refine_reference(X, blocks_a, blocks_b, C, ranks, *, n_iter_max: int, inner_iter: int, tol: float):
    """Algorithm 3 as written: each block refitted by :func:`fit_block` from the eigenvector start
    (and again warm-started when that is worse), on the dense (I, J, H) residual.
    Returns (blocks_a, blocks_b, C, history)."""
    H = X.shape[2]
    normY2 = float((X * X).sum())
    resid = _residual(X, blocks_a, blocks_b, C, ranks)
    err2 = float((resid * resid).sum())
    history = [_rel(err2, normY2)]
    for _ in range(n_iter_max):
        for b in range(H):
            L = ranks[b]
            if L == 0:
                continue
            Xb = resid + _block_tensor(blocks_a[b], blocks_b[b], C[:, b])
            cur = err2
            v0 = torch.linalg.qr(blocks_b[b])[0]
            a, bb, c, e2 = fit_block(Xb, L, n_iter=inner_iter, V0=v0)
            if e2 > cur:
                a, bb, c, e2 = fit_block(Xb, L, n_iter=inner_iter, c0=C[:, b], V0=v0)
            if e2 <= cur:
                blocks_a[b], blocks_b[b], C[:, b] = a, bb, c
                resid = Xb - _block_tensor(a, bb, c)
                err2 = float((resid * resid).sum())
        history.append(_rel(err2, normY2))
        if _sweeps_done(history, tol):
            break
    return blocks_a, blocks_b, C, history


def _refine_fast(X, blocks_a, blocks_b, C, ranks, *, n_iter_max: int, inner_iter: int, tol: float):
    """Algorithm 3 as block coordinate descent: each block refitted once per sweep, warm-started
    from its current fusion column c and right factor, on the head-major (H, I, J) residual R.

    With the block's current term ``Z = c' o (A' B'^T)`` and ``X' = R + Z`` (never formed), one
    refit takes ``M = sum_h c_h X'_h = sum_h c_h R_h + (c . c') A' B'^T`` (c = c' / |c'|), its rank-L
    SVD ``U S V^T`` (randomised, ``_SWEEP_POWER_ITERS`` power iterations from the current B'),
    ``T[h, l] = u_l^T X'_h v_l`` and ``T ~= s c d^T``, so that
    ``|X' - c o (U diag(w) V^T)|^2 = |X'|^2 - |w|^2`` (w = s d). For the current c the SVD step is
    the best rank-L matrix and the T step the best fusion column, so a refit cannot increase the error
    (up to the randomised SVD, hence the acceptance test). Each refit
    reads R three times (M, one batched product R_h [V, B'], the rank-2 update of R); the error is
    tracked by the identity above and recomputed exactly after each sweep (``inner_iter`` is not
    used: one alternation per refit, more sweeps instead). Returns (blocks_a, blocks_b, C, history).
    """
    H = X.shape[2]
    normY2 = float((X * X).sum())
    R = _residual(X, blocks_a, blocks_b, C, ranks).permute(2, 0, 1).contiguous()  # (H, I, J)
    Rf = R.view(H, -1)
    err2 = float((R * R).sum())
    history = [_rel(err2, normY2)]
    for _ in range(n_iter_max):
        for b, L in enumerate(ranks):
            if L == 0:
                continue
            a0, b0, c0 = blocks_a[b], blocks_b[b], C[:, b]
            c = c0 / c0.norm().clamp_min(1e-300)
            old = a0 @ b0.T
            M = torch.tensordot(c, R, dims=1) + float(c @ c0) * old
            U, V = _top_svd(M, L, torch.linalg.qr(b0)[0], n_power=_SWEEP_POWER_ITERS)
            RW = R @ torch.cat([V, b0], dim=1)  # (H, I, 2L): R_h V and R_h B'
            RV, RB = RW[..., :L], RW[..., L:]
            # T[h, l] = u_l^T R_h v_l + c'_h (u_l^T A')(B'^T v_l)
            T = (RV * U).sum(1) + c0[:, None] * ((U.T @ a0) * (b0.T @ V).T).sum(1)
            tu, ts, tvh = torch.linalg.svd(T, full_matrices=False)
            c_new, w = tu[:, 0], ts[0] * tvh[0]
            # |X'|^2 = |R|^2 + 2 <R, Z> + |Z|^2
            inner = float((c0 * (RB * a0).sum((1, 2))).sum())
            norm_z = float(c0 @ c0) * float(((a0.T @ a0) * (b0.T @ b0)).sum())
            e2 = err2 + 2 * inner + norm_z - float(w @ w)
            if e2 <= err2:
                new = (U * w) @ V.T
                Rf.addmm_(torch.stack([c0, -c_new], 1), torch.stack([old.flatten(), new.flatten()]))
                blocks_a[b], blocks_b[b], C[:, b], err2 = U * w, V, c_new, e2
        err2 = float((R * R).sum())
        history.append(_rel(err2, normY2))
        if _sweeps_done(history, tol):
            break
    return blocks_a, blocks_b, C, history


def _cp_starts(Y64, rank: int, wh, seed: int, impl: str, cp_kwargs: Optional[dict]) -> List[CPResult]:
    """The CP models whose blocks Algorithm 3 refines: the CPD-EPC one, and with ``impl="fast"``
    also the ALS one it was corrected from.

    Algorithm 3 ends in a local minimum that depends on its start, and neither start is better on
    every tensor (on DeiT-T's blocks each is ahead on some, by up to 0.2 %), so the fast path refines
    both and keeps the lower error: its CP stops early (relative change of the ALS error below 1e-3,
    of the EPC sensitivity below 3e-3) and its sweeps are cheap, so two starts cost less than the
    reference's one (100 ALS + 50 EPC iterations)."""
    kw = dict(seed=seed, impl=impl)
    if impl == "fast":
        kw.update(tol=1e-3, epc_tol=3e-3, epc_iter_max=50)
    kw.update(cp_kwargs or {})
    if impl != "fast" or not kw.get("epc", True):
        return [cp(Y64, rank, calib=wh, **kw)]
    epc_kw = dict(n_iter_max=kw.pop("epc_iter_max"), tol=kw.pop("epc_tol"))
    kw["epc"] = False
    als = cp(Y64, rank, calib=wh, **kw)
    return [correct_cp(Y64, als, calib=wh, impl=impl, **epc_kw), als]


def btd_ll1(Y: TensorLike, rank: Optional[int] = None, *, ranks: Optional[Sequence[int]] = None,
            cp_result: Optional[CPResult] = None, n_iter_max: Optional[int] = None, inner_iter: int = 3,
            tol: Optional[float] = None, cp_kwargs: Optional[dict] = None, seed: int = 0,
            calib: Optional[Union[torch.Tensor, Whitening]] = None, max_rank: Optional[int] = None,
            impl: str = "fast") -> BTDResult:
    """BTD-(L, L, 1) with CPD-EPC initialisation (IrrAtt paper, Algorithm 3).

    Args:
        Y: (I, J, H) dense tensor or :class:`HeadFactors` (formed densely here).
        rank: total rank R: a rank-R CPD-EPC (:func:`whiteformer.compress.cp`) is computed and
            turned into blocks and per-head ranks by Algorithm 1.
        ranks: alternatively the per-head block ranks (H ints); the blocks are then initialised by
            per-head truncated SVD with C = I (no CP).
        cp_result: a precomputed CP of the same (whitened) tensor, instead of computing it.
        n_iter_max: sweeps of Algorithm 3 (default 10 for "reference", 100 for "fast");
            inner_iter: iterations of Algorithm 2 per block ("reference" only).
        tol: stop when a sweep improves the relative error by less than ``tol`` (relative; default
            1e-3 for "reference", 1e-6 for "fast", whose sweeps are cheaper and each gains less).
        cp_kwargs: extra arguments for :func:`cp` (e.g. n_iter_max, epc). With ``impl="fast"`` the CP
            stops on a relative change of its error and of its sensitivity below 1e-3 per iteration
            (``tol=1e-3, epc_tol=3e-3``: it only initialises the blocks, which the sweeps refine),
            and both the ALS and the EPC-corrected models are refined (each to ``10 * tol``, then
            the better one to ``tol``; ``epc=False``: the ALS one only); "reference" keeps
            :func:`cp`'s defaults.
        calib: calibration tokens or :class:`Whitening` (activation-aware variant).
        max_rank: largest block rank (default ``min(I, J)``; IrrAtt passes the head dim D: a block
            starts inside one head's slice, whose rank is at most D, so more terms buy nothing).
            With a total ``rank``, terms Algorithm 1 gives a block beyond the cap are re-spent on the
            blocks with the next-largest gains (``_cap_and_respend``), so the total is kept.
        impl: "fast" (default: :mod:`.cp_fast`, and sweeps of single warm-started block refits,
            :func:`_refine_fast`) or "reference" (the plain CP loops and Algorithm 3 as written).
    Returns:
        :class:`BTDResult` (factors in the dtype of Y).
    """
    check_tensor_like(Y)
    check_choice(impl, "impl", ("fast", "reference"))
    fast = impl == "fast"
    n_iter_max = (100 if fast else 10) if n_iter_max is None else n_iter_max
    tol = (1e-6 if fast else 1e-3) if tol is None else tol
    I, J, H = Y.shape
    if ranks is not None and (rank is not None or cp_result is not None):
        raise ValueError("give either per-head `ranks` or a total `rank`/`cp_result`, not both")
    if rank is None and ranks is None and cp_result is None:
        raise ValueError("btd_ll1 needs the total rank `rank`, per-head `ranks` or a `cp_result`")
    cap = min(I, J) if max_rank is None else min(I, J, int(max_rank))
    if cap < 1:
        raise ValueError(f"max_rank must be a positive int, got {max_rank!r}")
    Y64 = as_float64(Y)
    wh = None
    if calib is not None:
        wh = calib if isinstance(calib, Whitening) else Whitening.from_calibration(calib, Y64.shape)
    X = to_dense(wh.apply(Y64) if wh is not None else Y64)
    if ranks is not None:
        ranks = normalize_ranks(ranks, H, cap, "ranks")
        blocks_a, blocks_b = [], []
        for h in range(H):
            u, s, vh = torch.linalg.svd(X[:, :, h], full_matrices=False)
            r = ranks[h]
            blocks_a.append(u[:, :r] * s[:r])
            blocks_b.append(vh[:r].T)
        starts = [(blocks_a, blocks_b, torch.eye(H, dtype=X.dtype, device=X.device), ranks, None)]
    else:
        if cp_result is None:
            check_int(rank, "rank", 1)
            cp_results = _cp_starts(Y64, rank, wh, seed, impl, cp_kwargs)
        else:
            check_instance(cp_result, "cp_result", CPResult, "a CPResult")
            shp = (cp_result.A.shape[0], cp_result.B.shape[0], cp_result.C.shape[0])
            if shp != (I, J, H):
                raise ValueError(f"cp_result is for a tensor of shape {shp}, Y has shape {(I, J, H)}")
            if rank is not None and rank != cp_result.rank:
                raise ValueError(f"rank {rank} does not match cp_result's rank {cp_result.rank}")
            cp_results = [cp_result]
        starts = []
        for cpres in cp_results:
            A0, B0 = cpres.A.to(X), cpres.B.to(X)
            if wh is not None:  # CP factors come in the original coordinates
                A0, B0 = wh.whiten_q(A0), wh.whiten_k(B0)
            blocks_a, blocks_b, C, r = btd_from_cp([A0, B0, cpres.C.to(X)])
            blocks_a, blocks_b, r = _cap_and_respend(X, blocks_a, blocks_b, r, cap)
            starts.append((blocks_a, blocks_b, C, r, cpres))

    refine = _refine_fast if impl == "fast" else _refine_reference
    # several starts: each refined to a 10x looser tolerance, then the best one to ``tol``
    best = None
    for blocks_a, blocks_b, C, r, cpres in starts:
        out = refine(X, blocks_a, blocks_b, C.clone(), r, n_iter_max=n_iter_max, inner_iter=inner_iter,
                     tol=tol * 10 if len(starts) > 1 else tol)
        if best is None or out[3][-1] < best[0][3][-1]:
            best = out, r, cpres
    (blocks_a, blocks_b, C, history), ranks, cpres = best
    if len(starts) > 1 and len(history) - 1 < n_iter_max:
        blocks_a, blocks_b, C, more = refine(X, blocks_a, blocks_b, C, ranks, n_iter_max=n_iter_max + 1 - len(history),
                                             inner_iter=inner_iter, tol=tol)
        history = history + more[1:]

    # balance each column pair: |a_l| = |b_l| (same block tensor)
    out_a, out_b = [], []
    for a, bb in zip(blocks_a, blocks_b):
        ratio = (bb.norm(dim=0).clamp_min(1e-300) / a.norm(dim=0).clamp_min(1e-300)).sqrt()
        a2, b2 = a * ratio, bb / ratio
        if wh is not None:
            a2, b2 = wh.unwhiten_q(a2), wh.unwhiten_k(b2)
        out_a.append(a2.to(Y.dtype))
        out_b.append(b2.to(Y.dtype))
    return BTDResult(out_a, out_b, C.to(Y.dtype), tuple(ranks), history[-1], history[0], history, cpres)
