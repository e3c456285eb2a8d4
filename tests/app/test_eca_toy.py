"""ECA toy experiment (ECAttention paper Sec. 4.1) at reduced size (d=64, n=200, L=3)."""
import builtins
import json

import pytest
import torch

from whiteformer.app import eca_toy
from whiteformer.app.eca_toy import SMALL, make_data, run
from whiteformer.ops.eca import eca_compress, eca_omega


def _strip_timing(obj):
    if isinstance(obj, dict):
        return {k: _strip_timing(v) for k, v in obj.items() if k not in ("time_s", "timing")}
    if isinstance(obj, list):
        return [_strip_timing(v) for v in obj]
    return obj


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    out = tmp_path_factory.mktemp("eca_toy")
    res = run(out, seed=0, small=True, plots=False, num_threads=1)
    return out, res


def test_json_written(toy):
    out, res = toy
    data = json.loads((out / "eca_toy.json").read_text())
    assert _strip_timing(data) == _strip_timing(json.loads(json.dumps(res)))
    for key in ("expansion", "compression", "expansion_noisy", "compression_variants",
                "compression_training", "cholesky_eps_sweep", "summary"):
        assert key in data
    L, d = SMALL.layers, SMALL.d
    assert len(data["expansion"]["layers"]) == L + 1
    assert len(data["expansion"]["cde"]) == L + 1 and len(data["expansion"]["cde"][0]) == d
    assert data["config"]["planted_rank"] == SMALL.planted_rank == 20


def test_planted_data():
    Z, U, labels = make_data(SMALL, seed=3, dtype=torch.float64)
    assert Z.shape == (SMALL.n, SMALL.d) and U.shape == (SMALL.d, SMALL.num_subspaces * SMALL.subspace_dim)
    torch.testing.assert_close(U.T @ U, torch.eye(U.shape[1], dtype=torch.float64))
    assert torch.linalg.matrix_rank(Z).item() == SMALL.planted_rank
    # each sample lies in the first active_dims directions of its own subspace
    codes = (Z @ U).reshape(SMALL.n, SMALL.num_subspaces, SMALL.subspace_dim)
    own = codes[torch.arange(SMALL.n), labels]
    assert own[:, SMALL.active_dims:].abs().max() < 1e-10
    assert (codes.square().sum(-1) > 1e-12).sum(-1).eq(1).all()


def test_R_rises_under_expansion(toy):
    R = [row["R"] for row in toy[1]["expansion"]["layers"]]
    assert all(b > a for a, b in zip(R, R[1:])), R
    assert toy[1]["summary"]["R_rises_under_expansion"]


def test_R_c_falls_under_compression(toy):
    Rc = [row["R_c"] for row in toy[1]["compression"]["layers"]]
    assert all(b < a for a, b in zip(Rc, Rc[1:])), Rc
    assert toy[1]["summary"]["R_c_falls_under_compression"]


def test_rank_under_expansion(toy):
    """Clean data: Q spans a subspace of range(Z), so the numerical rank stays the planted rank
    (the expansion output lies in range(Z)). With noise in the null space of the planted data,
    expansion amplifies it: the energy outside the planted directions grows every layer and the
    number of directions holding 99.9 % of the energy grows past the planted rank."""
    res = toy[1]
    P = SMALL.planted_rank
    assert [row["rank"] for row in res["expansion"]["layers"]] == [P] * (SMALL.layers + 1)
    noisy = res["expansion_noisy"]["layers"]
    out_e = [row["energy_outside_planted"] for row in noisy]
    assert all(b > a for a, b in zip(out_e, out_e[1:])), out_e
    assert noisy[0]["dims_999"] <= P < noisy[-1]["dims_999"]


def test_compression_variants_and_training_recorded(toy):
    res = toy[1]
    col = res["compression_variants"]["column_space_projection"]["layers"]
    assert len(col) == SMALL.layers + 1
    assert col[0]["R_c"] == res["compression"]["layers"][0]["R_c"]  # same input
    for v in ("null_space_subtraction", "column_space_projection"):
        h = res["compression_training"][v]
        assert len(h["loss"]) == SMALL.epochs + 1
        assert all(abs(loss - (rc - r)) < 1e-9 for loss, rc, r in zip(h["loss"], h["R_c"], h["R"]))


def test_null_space_parts_match_eca_compress():
    """The toy's column-space variant shares pi and Q_k with ops.eca_compress."""
    Z, U, _ = make_data(SMALL, seed=1, dtype=torch.float64)
    omega = eca_omega(SMALL.n, SMALL.rank, 1, 7, dtype=torch.float64)
    pi, null, col = eca_toy._compression_parts(Z, U, omega, SMALL, SMALL.eps)
    ref, ref_pi = eca_compress(Z[None], U, omega, SMALL.temperature, SMALL.num_subspaces, SMALL.eps, return_pi=True)
    torch.testing.assert_close(null, ref[0])
    torch.testing.assert_close(pi, ref_pi[0].T)
    # on planted data the two parts add up to sum_k pi_k U_k U_k^T z
    Uk = U.reshape(SMALL.d, SMALL.num_subspaces, -1).permute(1, 0, 2)
    full = torch.einsum("nk,kdp,kep,ne->nd", pi, Uk, Uk, Z)
    torch.testing.assert_close(null + col, full)


def test_eps_sweep(toy):
    rows = toy[1]["cholesky_eps_sweep"]
    assert {r["eps"] for r in rows} == set(SMALL.eps_sweep)
    over = {r["eps"]: r for r in rows if r["setting"] == "over_sketched"}
    # sketch rank > subspace dimension: singular Gram matrices, Cholesky fails at eps = 0 only
    assert over[0.0]["fail_rate_percent"] == 100.0
    assert over[1e-2]["fail_rate_percent"] == 0.0
    assert all(r["calls"] > 0 and r["finite"] for r in rows)


def test_deterministic_for_seed_and_cli(toy, tmp_path):
    from whiteformer.app.cli import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the fixture's thread count: results are bit-wise the same for the same count
    try:
        assert main(["analyze", "eca-toy", "--out", str(tmp_path / "cli"), "--small", "--no-plots", "--seed", "0"]) == 0
    finally:
        torch.set_num_threads(threads)
    again = json.loads((tmp_path / "cli" / "eca_toy.json").read_text())
    first = json.loads((toy[0] / "eca_toy.json").read_text())
    assert _strip_timing(again) == _strip_timing(first)
    other = make_data(SMALL, seed=1)[0]
    assert not torch.equal(other, make_data(SMALL, seed=0)[0])


def test_missing_matplotlib_message(monkeypatch, tmp_path, capsys):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("no matplotlib")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    assert eca_toy._plot(tmp_path, {}, SMALL) == []
    assert "pip install whiteformer[viz]" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())
