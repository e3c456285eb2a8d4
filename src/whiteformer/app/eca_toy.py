"""The ECAttention toy experiment (ECAttention paper, Sec. 4.1, Fig. 3, 4 and 13, Table 10).

Data (Sec. 4.1): K = 6 mutually orthogonal subspaces of R^384 with orthonormal bases
U_k (384 x 64); n = 1000 samples z = U_k a where only the first 20 entries of a are active
(a ~ N(0, I_20)), sample i in subspace i mod K; overall rank 6 * 20 = 120.

Experiments (tokens as rows, Z (n, d); one "sequence" of n tokens):

1. Fig. 3a/3b: L expansion-only layers ``z <- z + alpha * eca_expand(z)`` and, separately, L
   compression-only layers ``z <- z - beta * eca_compress(z | U = true bases)``; per layer the
   coding rate R(Z) (ToST/ECA Eq. 1), the subspace compression term R_c(Z | U_[K]) (ECA Eq. 2),
   the numerical rank, the number of eigen-directions holding 90/99/99.9 % of the energy, and the
   cumulative eigenvalue distribution (CDE) of Z Z^T (paper notation; Z^T Z here).
   The same expansion run is repeated on the data plus small isotropic noise (``noise_std``),
   which puts energy in the null space null(Z^T) of the planted data.
2. Fig. 4/13: compression by subtracting the null-space projection (ECA Eq. 8) vs by projecting
   onto the column space, ``z <- sum_k pi_k U_k Q_k Q_k^T U_k^T z``: (c, d) layer-wise with the
   true bases; (a, b) multi-epoch optimisation of the per-layer bases U^l of a
   ``train_layers``-layer stack (random orthonormal init, Adam) minimising
   -ΔR = R_c(Ẑ^L | U_true) - R(Ẑ^L) of the row-normalised output Ẑ^L.
3. Table 10: Cholesky regulariser sweep; fallback (QR) rate of the basis computations and time
   of the L expansion + L compression layers, at the paper's sketch rank and at an over-sketched
   rank (sketch rank > subspace dimension, so the Gram matrices are singular).

Step sizes: Sec. 4.1 gives no values, so the paper's initial values are used (Sec. 4: alpha =
beta = 0.1, r = 20, Cholesky eps = 1e-2) with L = 12 layers (ECA-S: d = 384, L = 12).

Run: ``whiteformer analyze eca-toy --out DIR`` (or :func:`run`). Writes
``eca_toy.json`` and, if matplotlib is installed (``pip install whiteformer[viz]``),
``fig3_rates.png``, ``fig3_cde.png`` and ``fig4_compression_variants.png``.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from .._files import save_figure, write_text
from .._progress import NO_BAR, progress_bar
from ..analysis._viz import new_figure, require_matplotlib
from ..analysis.rates import coding_rate, subspace_compression_rate
from ..ops.eca import (
    cholesky_stats,
    eca_compress,
    eca_expand,
    eca_omega,
    orthonormal_basis,
    reset_cholesky_fallback_count,
)

__all__ = ["ToyConfig", "SMALL", "run", "make_data", "check_overrides"]

_EXPAND_STREAM = 0  # eca_omega stream offsets: one sketch per layer and module
_COMPRESS_STREAM = 10_000
_OVER_STREAM = 20_000


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    """Sizes and step sizes of the toy (defaults: paper Sec. 4.1 and Sec. 4 init values)."""

    d: int = 384  # feature dimension
    num_subspaces: int = 6  # K (= heads of the compression module)
    subspace_dim: int = 64  # p, columns of each U_k
    active_dims: int = 20  # directions of U_k used by the data
    n: int = 1000  # samples (tokens)
    layers: int = 12  # L
    alpha: float = 0.1  # expansion step
    beta: float = 0.1  # compression step
    rank: int = 20  # sketch rank r per subspace (expansion uses K * r)
    eps: float = 1e-2  # Cholesky regulariser
    temperature: float = 1.0  # eta of Eq. 7
    rate_eps: float = 0.5  # eps of the coding rates R and R_c
    noise_std: float = 1e-2  # isotropic noise of the "noisy" expansion run
    epochs: int = 20  # multi-epoch compression optimisation (Fig. 4/13 a, b)
    train_layers: int = 4  # layers of the trained compression stack (kept small: CPU time)
    lr: float = 1e-2
    eps_sweep: tuple = (0.0, 1e-4, 1e-3, 1e-2, 1e-1)
    sweep_repeats: int = 3

    @property
    def planted_rank(self) -> int:
        return self.num_subspaces * self.active_dims


# reduced size for tests: planted rank 20 in d = 64
SMALL = ToyConfig(d=64, num_subspaces=4, subspace_dim=16, active_dims=5, n=200, layers=3, rank=5,
                  epochs=3, train_layers=2, sweep_repeats=1)


# ----------------------------------------------------------------------------- data
def make_data(cfg: ToyConfig, seed: int = 0, dtype: torch.dtype = torch.float32):
    """Returns (Z (n, d), U (d, K*p) = [U_1 ... U_K], labels (n,)). Built in float64, cast to dtype."""
    if cfg.num_subspaces * cfg.subspace_dim > cfg.d:
        raise ValueError(
            f"K * p = {cfg.num_subspaces * cfg.subspace_dim} orthogonal directions do not fit in d = {cfg.d}"
        )
    if not 1 <= cfg.active_dims <= cfg.subspace_dim:
        raise ValueError(f"active_dims must be in [1, subspace_dim = {cfg.subspace_dim}], got {cfg.active_dims}")
    g = torch.Generator().manual_seed(seed)
    K, p, r = cfg.num_subspaces, cfg.subspace_dim, cfg.active_dims
    basis = torch.linalg.qr(torch.randn(cfg.d, cfg.d, generator=g, dtype=torch.float64))[0]
    U = basis[:, : K * p]
    labels = torch.arange(cfg.n) % K
    coef = torch.randn(cfg.n, r, generator=g, dtype=torch.float64)
    Ub = U.reshape(cfg.d, K, p)[:, labels, :r]  # (d, n, r): active directions of each sample's subspace
    Z = torch.einsum("dnr,nr->nd", Ub, coef)
    return Z.to(dtype), U.to(dtype), labels


# ----------------------------------------------------------------------------- layers
def _expand_layer(Z, cfg: ToyConfig, layer: int, seed: int, eps: float, rank: Optional[int] = None,
                  stream=_EXPAND_STREAM):
    R = cfg.num_subspaces * (cfg.rank if rank is None else rank)
    omega = eca_omega(Z.shape[0], R, seed, stream + layer, dtype=Z.dtype)
    return Z + cfg.alpha * eca_expand(Z[None], omega, eps)[0]


def _compress_layer(Z, U, cfg: ToyConfig, layer: int, seed: int, eps: float, rank: Optional[int] = None,
                    stream=_COMPRESS_STREAM):
    omega = eca_omega(Z.shape[0], cfg.rank if rank is None else rank, seed, stream + layer, dtype=Z.dtype)
    return Z - cfg.beta * eca_compress(Z[None], U, omega, cfg.temperature, cfg.num_subspaces, eps)[0]


def _compression_parts(Z, U, omega, cfg: ToyConfig, eps: float):
    """Shared pieces of both compression variants: memberships pi (n, K) (Eq. 7), the
    null-space part sum_k pi_k U_k (I - Q_k Q_k^T) a_k (Eq. 8) and the column-space projection
    sum_k pi_k U_k Q_k Q_k^T a_k, each (n, d)."""
    K = cfg.num_subspaces
    codes = (Z @ U).reshape(Z.shape[0], K, -1).transpose(0, 1)  # (K, n, p)
    Q = orthonormal_basis(codes.transpose(-1, -2) @ omega, eps)  # (K, p, r)
    col = (codes @ Q) @ Q.transpose(-1, -2)
    pi = torch.softmax(col.square().sum(-1) / (2 * cfg.temperature), dim=0)  # (K, n)
    Uk = U.reshape(U.shape[0], K, -1).permute(1, 0, 2)  # (K, d, p)
    back = lambda a: torch.einsum("kn,knp,kdp->nd", pi, a, Uk)  # noqa: E731
    return pi.T, back(codes - col), back(col)


def _column_layer(Z, U, cfg: ToyConfig, layer: int, seed: int, eps: float):
    omega = eca_omega(Z.shape[0], cfg.rank, seed, _COMPRESS_STREAM + layer, dtype=Z.dtype)
    return _compression_parts(Z, U, omega, cfg, eps)[2]


# ----------------------------------------------------------------------------- statistics
def _spectrum(Z: torch.Tensor) -> torch.Tensor:
    """Eigenvalues of the d x d Gram Z^T Z (= Z Z^T of the paper), descending, in float64."""
    Zd = Z.detach().double()
    return torch.linalg.eigvalsh(Zd.T @ Zd).flip(0).clamp_min(0)


def _layer_stats(Z, U, cfg: ToyConfig, ev: torch.Tensor) -> Dict[str, float]:
    Zd, Ud = Z.detach().double(), U.detach().double()
    # numerical rank, torch.linalg.matrix_rank convention for the compute dtype
    tol = max(Z.shape) * torch.finfo(Z.dtype).eps * ev[0].sqrt()
    cde = ev.cumsum(0) / ev.sum()
    dims = lambda q: int((cde < q).sum().item()) + 1  # noqa: E731
    return {
        "R": coding_rate(Zd, cfg.rate_eps).item(),
        "R_c": subspace_compression_rate(Zd, Ud, cfg.rate_eps, num_heads=cfg.num_subspaces).item(),
        "rank": int((ev.sqrt() > tol).sum().item()),
        "dims_90": dims(0.90),
        "dims_99": dims(0.99),
        "dims_999": dims(0.999),
        "energy_outside_planted": float((1 - cde[cfg.planted_rank - 1]).item()),
    }


def _track(Z0, U, cfg: ToyConfig, step, bar=NO_BAR) -> Dict[str, list]:
    """Apply ``step(Z, layer)`` L times; per-layer stats (layer 0 = input) and CDE curves; ``bar``
    advances once per layer (L + 1 steps)."""
    layers, cdes = [], []
    Z = Z0
    for layer in range(cfg.layers + 1):
        if layer > 0:
            with torch.no_grad():
                Z = step(Z, layer - 1)
        ev = _spectrum(Z)
        layers.append({"layer": layer, **_layer_stats(Z, U, cfg, ev)})
        cdes.append([round(v, 7) for v in (ev.cumsum(0) / ev.sum()).tolist()])
        bar.update(1)
    return {"layers": layers, "cde": cdes}


# ----------------------------------------------------------------------------- Fig. 4/13 (a, b)
def _train_compression(Z0, U_true, cfg: ToyConfig, seed: int, variant: str, bar=NO_BAR) -> Dict[str, list]:
    """Multi-epoch optimisation of per-layer bases; loss -ΔR of the row-normalised output; ``bar``
    advances once per epoch (epochs + 1 steps)."""
    g = torch.Generator().manual_seed(seed + 1)
    K, p = cfg.num_subspaces, cfg.subspace_dim
    Us = [torch.linalg.qr(torch.randn(cfg.d, K * p, generator=g, dtype=torch.float64))[0].to(Z0.dtype)
          .requires_grad_(True) for _ in range(cfg.train_layers)]
    opt = torch.optim.Adam(Us, lr=cfg.lr)
    Ut = U_true.double()
    hist = {"epoch": [], "loss": [], "R": [], "R_c": []}
    for epoch in range(cfg.epochs + 1):
        Z = Z0
        for layer, U in enumerate(Us):
            if variant == "null_space_subtraction":
                Z = _compress_layer(Z, U, cfg, layer, seed, cfg.eps)
            else:
                Z = _column_layer(Z, U, cfg, layer, seed, cfg.eps)
        Zn = F.normalize(Z.double(), dim=-1)
        R = coding_rate(Zn, cfg.rate_eps)
        Rc = subspace_compression_rate(Zn, Ut, cfg.rate_eps, num_heads=K)
        loss = Rc - R
        hist["epoch"].append(epoch)
        hist["loss"].append(loss.item())
        hist["R"].append(R.item())
        hist["R_c"].append(Rc.item())
        bar.update(1)
        if epoch == cfg.epochs:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    return hist


# ----------------------------------------------------------------------------- Table 10
def _sweep_settings(cfg: ToyConfig) -> List[tuple]:
    """(name, sketch rank) of the Cholesky sweep: the paper's rank, and an over-sketched one when it fits."""
    settings = [("paper", cfg.rank)]
    over = min(2 * cfg.active_dims, cfg.subspace_dim, cfg.n, cfg.d // cfg.num_subspaces)
    if over > cfg.active_dims:
        settings.append(("over_sketched", over))
    return settings


def _eps_sweep(Z0, U, cfg: ToyConfig, seed: int, bar=NO_BAR) -> List[Dict[str, float]]:
    """Table 10's rows; ``bar`` advances after the warm-up and after each repeat (:func:`_num_steps`)."""
    rows = []
    settings = _sweep_settings(cfg)

    def stack(eps, r):
        Ze, Zc = Z0, Z0
        for layer in range(cfg.layers):
            Ze = _expand_layer(Ze, cfg, layer, seed, eps, rank=r, stream=_OVER_STREAM)
            Zc = _compress_layer(Zc, U, cfg, layer, seed, eps, rank=r, stream=_OVER_STREAM)
        return Ze, Zc

    with torch.no_grad():
        stack(cfg.eps, cfg.rank)  # warm-up
        bar.update(1)
        for name, r in settings:
            for eps in cfg.eps_sweep:
                reset_cholesky_fallback_count()
                t0 = time.perf_counter()
                for _ in range(cfg.sweep_repeats):
                    Ze, Zc = stack(eps, r)
                    bar.update(1)
                dt = (time.perf_counter() - t0) / cfg.sweep_repeats
                st = cholesky_stats()
                rows.append({
                    "setting": name, "sketch_rank": r, "eps": eps,
                    "calls": st["calls"], "fallback_calls": st["fallback_calls"],
                    "fail_rate_percent": 100.0 * st["fail_rate"],
                    "finite": bool(torch.isfinite(Ze).all() and torch.isfinite(Zc).all()),
                    "time_s": dt,
                })
    return rows


# ----------------------------------------------------------------------------- plots
def _plot(out: Path, res: dict, cfg: ToyConfig) -> List[str]:
    try:
        require_matplotlib("the ECA toy figures")
    except ImportError:
        print("matplotlib is not installed: wrote the JSON only. For the PNG figures install the "
              "viz extra: pip install whiteformer[viz]")
        return []

    def subplots(cols, size):  # a pyplot-free figure: the user's backend is never touched
        fig = new_figure(size, 120)
        return fig, fig.subplots(1, cols)

    files = []
    lay = lambda key, m: [row[m] for row in res[key]["layers"]]  # noqa: E731
    x = list(range(cfg.layers + 1))
    fig, ax = subplots(2, (10, 4))
    ax[0].plot(x, lay("expansion", "R"), "o-", label="R(Z), expansion-only")
    ax[0].plot(x, lay("compression", "R"), "s--", label="R(Z), compression-only")
    ax[0].set_title("expansion term R(Z)")
    ax[1].plot(x, lay("expansion", "R_c"), "o--", label="R_c(Z|U), expansion-only")
    ax[1].plot(x, lay("compression", "R_c"), "s-", label="R_c(Z|U), compression-only")
    ax[1].set_title("compression term R_c(Z|U_[K])")
    for a in ax:
        a.set_xlabel("layer")
        a.legend()
    fig.tight_layout()
    save_figure(fig, out / "fig3_rates.png", dpi=120)
    files.append("fig3_rates.png")

    fig, ax = subplots(3, (14, 4))
    idx = list(range(1, cfg.d + 1))
    for a, key, title in zip(ax, ("expansion", "compression", "expansion_noisy"),
                             ("expansion", "compression", f"expansion, noise {cfg.noise_std:g}")):
        for layer in (0, cfg.layers // 2, cfg.layers):
            a.plot(idx, res[key]["cde"][layer], label=f"layer {layer}")
        a.axvline(cfg.planted_rank, color="gray", ls=":", label=f"planted rank {cfg.planted_rank}")
        a.set_xlim(0, min(cfg.d, 3 * cfg.planted_rank))
        a.set_title(f"CDE of ZZ^T, {title}")
        a.set_xlabel("number of eigenvalues")
        a.legend()
    fig.tight_layout()
    save_figure(fig, out / "fig3_cde.png", dpi=120)
    files.append("fig3_cde.png")

    fig, ax = subplots(2, (10, 4))
    for v, st in (("null_space_subtraction", "o-"), ("column_space_projection", "s--")):
        ax[0].plot(x, [r["R_c"] for r in res["compression_variants"][v]["layers"]], st, label=v)
        h = res["compression_training"][v]
        ax[1].plot(h["epoch"], h["loss"], st, label=v)
    ax[0].set_title("layer-wise R_c(Z|U_[K]) (true bases)")
    ax[0].set_xlabel("layer")
    ax[1].set_title("training: R_c(Z^L|U) - R(Z^L), normalised Z^L")
    ax[1].set_xlabel("epoch")
    for a in ax:
        a.legend()
    fig.tight_layout()
    save_figure(fig, out / "fig4_compression_variants.png", dpi=120)
    files.append("fig4_compression_variants.png")
    return files


# ----------------------------------------------------------------------------- driver
def _num_steps(cfg: ToyConfig) -> int:
    """Steps of the whole run's progress bar: four tracks of L + 1 layers, two trainings of epochs + 1,
    the sweep's warm-up and its repeats."""
    sweep = len(_sweep_settings(cfg)) * len(cfg.eps_sweep) * cfg.sweep_repeats
    return 4 * (cfg.layers + 1) + 2 * (cfg.epochs + 1) + 1 + sweep


def run(out_dir, seed: int = 0, *, config: Optional[ToyConfig] = None, small: bool = False,
        plots: bool = True, dtype: torch.dtype = torch.float32, num_threads: Optional[int] = None,
        progress: bool = False, **overrides) -> dict:
    """Run the toy experiment and write ``out_dir/eca_toy.json`` (+ PNGs if matplotlib is present).

    Args:
        out_dir: output directory (created).
        seed: seed of the data, the sketches (``eca_omega``) and the training init; the results
            (everything except the ``time_s`` / ``timing`` entries) are deterministic for a seed.
        config: a :class:`ToyConfig` (default: the paper's sizes, or :data:`SMALL` if ``small``).
        num_threads: if given, torch's intra-op threads during the run (restored afterwards). The
            sizes are small: 1 thread is fastest on a loaded machine, and results are bit-wise
            reproducible only for the same thread count.
        progress: a tqdm bar over the whole run (each stage named, ETA) when stderr is a terminal.
        overrides: fields of the config to replace, e.g. ``layers=6``.
    Returns:
        the result dictionary written to the JSON file.
    """
    if num_threads is None:
        return _run(out_dir, seed, config, small, plots, dtype, overrides, progress)
    old = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        return _run(out_dir, seed, config, small, plots, dtype, overrides, progress)
    finally:
        torch.set_num_threads(old)


#: bounds of the toy's sizes (checked before anything is built): the data is (d, n, active_dims) float64
MAX_ELEMENTS = 2 ** 27
MAX_DEPTH = 1024  # layers, train_layers
MAX_REPEATS = 10_000  # epochs, sweep_repeats
_AT_LEAST_0 = {"epochs", "eps", "noise_std", "alpha", "beta"}


def check_overrides(overrides, base: Optional[ToyConfig] = None) -> None:
    """Every name in ``overrides`` is a field of :class:`ToyConfig` with a value of its type and range,
    and the resulting sizes (``base`` with the overrides; default :class:`ToyConfig`) are bounded; else a ``ValueError`` naming
    the option (a non-finite step or a huge size would give NaN results or exhaust memory)."""
    import math

    from .._checks import is_int, is_real

    fields = {f.name: f.type for f in dataclasses.fields(ToyConfig)}
    unknown = sorted(k for k in overrides if k not in fields)
    if unknown:
        raise ValueError(f"unknown eca-toy option(s) {', '.join(map(repr, unknown))}; valid options: "
                         f"{', '.join(fields)}")
    for k, v in overrides.items():
        low = 0 if k in _AT_LEAST_0 else 1
        kind = fields[k] if isinstance(fields[k], str) else fields[k].__name__
        if kind == "int" and not (is_int(v) and v >= low):
            raise ValueError(f"eca-toy option {k} must be an integer >= {low}, got {v!r}")
        if kind == "float" and not (is_real(v) and math.isfinite(v) and (v >= 0 if low == 0 else v > 0)):
            raise ValueError(f"eca-toy option {k} must be a finite number {'>= 0' if low == 0 else '> 0'}, got {v!r}")
        if kind == "tuple" and not (isinstance(v, (list, tuple)) and v
                                    and all(is_real(e) and math.isfinite(e) and e >= 0 for e in v)):
            raise ValueError(f"eca-toy option {k} must be a non-empty list of finite numbers >= 0, got {v!r}")
    cfg = dataclasses.replace(base or ToyConfig(), **overrides)
    if cfg.num_subspaces * cfg.subspace_dim > cfg.d:
        raise ValueError(f"eca-toy: num_subspaces * subspace_dim = {cfg.num_subspaces * cfg.subspace_dim} orthogonal "
                         f"directions do not fit in d = {cfg.d}")
    if not cfg.active_dims <= cfg.subspace_dim:
        raise ValueError(f"eca-toy option active_dims must be <= subspace_dim = {cfg.subspace_dim}, got {cfg.active_dims}")
    size = max(cfg.d * cfg.d, cfg.d * cfg.n * cfg.active_dims, cfg.n * cfg.num_subspaces * cfg.rank)
    if size > MAX_ELEMENTS:
        raise ValueError(f"eca-toy sizes too large (d={cfg.d}, n={cfg.n}, active_dims={cfg.active_dims}, "
                         f"rank={cfg.rank}: {size} elements in one tensor, at most {MAX_ELEMENTS})")
    for k in ("layers", "train_layers", "epochs", "sweep_repeats"):
        cap = MAX_DEPTH if "layers" in k else MAX_REPEATS
        if getattr(cfg, k) > cap:
            raise ValueError(f"eca-toy option {k} must be at most {cap}, got {getattr(cfg, k)}")


def _run(out_dir, seed, config, small, plots, dtype, overrides, progress=False) -> dict:
    t_start = time.perf_counter()
    cfg = config or (SMALL if small else ToyConfig())
    check_overrides(overrides, cfg)
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    Z0, U, labels = make_data(cfg, seed, dtype)
    g = torch.Generator().manual_seed(seed + 2)
    Zn0 = Z0 + cfg.noise_std * torch.randn(Z0.shape, generator=g, dtype=torch.float64).to(dtype)

    res: dict = {"config": {**dataclasses.asdict(cfg), "planted_rank": cfg.planted_rank}, "seed": seed,
                 "dtype": str(dtype).replace("torch.", ""), "threads": torch.get_num_threads()}
    with progress_bar(_num_steps(cfg), "eca-toy", "step", enabled=progress) as bar:
        bar.set_description_str("eca-toy: expansion")
        res["expansion"] = _track(Z0, U, cfg, lambda Z, l: _expand_layer(Z, cfg, l, seed, cfg.eps), bar)
        bar.set_description_str("eca-toy: compression")
        res["compression"] = _track(Z0, U, cfg, lambda Z, l: _compress_layer(Z, U, cfg, l, seed, cfg.eps), bar)
        bar.set_description_str("eca-toy: noisy expansion")
        res["expansion_noisy"] = _track(Zn0, U, cfg, lambda Z, l: _expand_layer(Z, cfg, l, seed, cfg.eps), bar)
        bar.set_description_str("eca-toy: column projection")
        res["compression_variants"] = {
            "null_space_subtraction": res["compression"],
            "column_space_projection": _track(Z0, U, cfg, lambda Z, l: _column_layer(Z, U, cfg, l, seed, cfg.eps),
                                              bar),
        }
        bar.set_description_str("eca-toy: training")
        res["compression_training"] = {
            v: _train_compression(Z0, U, cfg, seed, v, bar)
            for v in ("null_space_subtraction", "column_space_projection")
        }
        bar.set_description_str("eca-toy: Cholesky sweep")
        res["cholesky_eps_sweep"] = _eps_sweep(Z0, U, cfg, seed, bar)

    first = lambda key: res[key]["layers"][0]  # noqa: E731
    last = lambda key: res[key]["layers"][-1]  # noqa: E731
    tr = res["compression_training"]
    monotone = lambda key, m, sign: all(  # noqa: E731
        sign * (b[m] - a[m]) > 0 for a, b in zip(res[key]["layers"], res[key]["layers"][1:]))
    ends = lambda rows: [rows[0], rows[-1]]  # noqa: E731
    res["summary"] = {
        "R_expansion_first_last": [first("expansion")["R"], last("expansion")["R"]],
        "R_c_compression_first_last": [first("compression")["R_c"], last("compression")["R_c"]],
        "R_rises_under_expansion": monotone("expansion", "R", +1),
        "R_c_falls_under_compression": monotone("compression", "R_c", -1),
        "rank_first_last_expansion": [first("expansion")["rank"], last("expansion")["rank"]],
        "rank_first_last_compression": [first("compression")["rank"], last("compression")["rank"]],
        "rank_exceeds_planted_under_expansion": last("expansion")["rank"] > cfg.planted_rank,
        "dims_99_first_last_expansion_noisy": [first("expansion_noisy")["dims_99"], last("expansion_noisy")["dims_99"]],
        "dims_999_first_last_expansion_noisy": [first("expansion_noisy")["dims_999"],
                                                last("expansion_noisy")["dims_999"]],
        "energy_outside_planted_first_last_expansion_noisy": [
            first("expansion_noisy")["energy_outside_planted"], last("expansion_noisy")["energy_outside_planted"]],
        "effective_dims_exceed_planted_under_noisy_expansion": last("expansion_noisy")["dims_99"] > cfg.planted_rank,
        "R_c_last_layer_null_vs_column": [last("compression")["R_c"],
                                           res["compression_variants"]["column_space_projection"]["layers"][-1]["R_c"]],
        "R_last_layer_null_vs_column": [last("compression")["R"],
                                         res["compression_variants"]["column_space_projection"]["layers"][-1]["R"]],
        "training_loss_first_last_null": ends(tr["null_space_subtraction"]["loss"]),
        "training_loss_first_last_column": ends(tr["column_space_projection"]["loss"]),
    }
    res["figures"] = _plot(out, res, cfg) if plots else []
    res["timing"] = {"total_s": time.perf_counter() - t_start}
    write_text(out / "eca_toy.json", json.dumps(res, indent=1))
    return res


def _format_summary(res: dict) -> str:
    s, c = res["summary"], res["config"]
    lines = [
        f"ECA toy (d={c['d']}, K={c['num_subspaces']}, planted rank {c['planted_rank']}, n={c['n']}, L={c['layers']}, "
        f"alpha={c['alpha']}, beta={c['beta']}, r={c['rank']}, eps={c['eps']})",
        f"  expansion:   R {s['R_expansion_first_last'][0]:.2f} -> {s['R_expansion_first_last'][1]:.2f} "
        f"(rises every layer: {s['R_rises_under_expansion']}); rank {s['rank_first_last_expansion']}",
        f"  compression: R_c {s['R_c_compression_first_last'][0]:.2f} -> {s['R_c_compression_first_last'][1]:.2f} "
        f"(falls every layer: {s['R_c_falls_under_compression']}); rank {s['rank_first_last_compression']}",
        f"  noisy expansion (noise {c['noise_std']}): dims for 99% / 99.9% energy "
        f"{s['dims_99_first_last_expansion_noisy']} / {s['dims_999_first_last_expansion_noisy']}, "
        f"energy outside the planted rank {s['energy_outside_planted_first_last_expansion_noisy'][0]:.2e} -> "
        f"{s['energy_outside_planted_first_last_expansion_noisy'][1]:.2e}",
        f"  last layer, null-space subtraction vs column projection: R_c "
        f"{s['R_c_last_layer_null_vs_column'][0]:.2f} vs {s['R_c_last_layer_null_vs_column'][1]:.2f}, R "
        f"{s['R_last_layer_null_vs_column'][0]:.2f} vs {s['R_last_layer_null_vs_column'][1]:.2f}",
        f"  training -DeltaR first->last epoch: null {s['training_loss_first_last_null'][0]:.2f} -> "
        f"{s['training_loss_first_last_null'][1]:.2f}; column {s['training_loss_first_last_column'][0]:.2f} -> "
        f"{s['training_loss_first_last_column'][1]:.2f}",
        "  Cholesky eps sweep (setting, r, eps: fail rate %, time s):",
    ]
    for row in res["cholesky_eps_sweep"]:
        lines.append(f"    {row['setting']:13s} r={row['sketch_rank']:3d} eps={row['eps']:<7g}: "
                     f"{row['fail_rate_percent']:6.2f} %  {row['time_s']:.3f} s  finite={row['finite']}")
    lines.append(f"  total time {res['timing']['total_s']:.1f} s")
    return "\n".join(lines)
