"""Offline datasets: digits, MNIST (IDX), image folders, subspaces, text, ListOps, augmentation."""
import gzip
import lzma
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch

from whiteformer.app.data import build_dataset, list_datasets
from whiteformer.app.data.augment import Augment, hflip, translate
from whiteformer.app.data.listops import VOCAB, evaluate, generate_expression, tokenize
from whiteformer.app.data.mnist import read_idx
from whiteformer.app.data.subspaces import sample_subspaces, subspace_bases


def _existing(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} not found (set WHITEFORMER_DATA_DIR to the folder holding it)")
    return path


# ----------------------------------------------------------------------------- registry
def test_registry_lists_all_datasets():
    assert set(list_datasets()) >= {"digits", "mnist", "image-folder", "subspaces", "text", "listops"}


def test_unknown_dataset_suggests_a_name():
    with pytest.raises(ValueError, match="unknown dataset 'digit'.*did you mean 'digits'"):
        build_dataset("digit")


def test_unknown_argument_and_split():
    with pytest.raises(TypeError, match="unknown argument.*'colour'.*valid arguments"):
        build_dataset("digits", "train", colour=True)
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        build_dataset("digits", "dev")


# ----------------------------------------------------------------------------- digits
def test_digits_fixed_stratified_split():
    tr, te = build_dataset("digits", "train"), build_dataset("digits", "test")
    assert (len(tr), len(te)) == (1438, 359)
    assert len(tr) + len(te) == 1797
    frac = te.label_counts().float() / (tr.label_counts() + te.label_counts()).float()
    assert torch.all((frac - 0.2).abs() < 0.02)
    x, y = tr.get_batch(torch.arange(len(tr)))
    assert x.shape == (1438, 1, 8, 8) and y.dtype == torch.int64
    assert abs(float(x.mean())) < 1e-4 and abs(float(x.std()) - 1) < 1e-3  # train statistics
    # The split is fixed: a second build gives the same samples; train and test are disjoint.
    x2, y2 = build_dataset("digits", "train").get_batch(torch.arange(len(tr)))
    assert torch.equal(x, x2) and torch.equal(y, y2)
    xt, _ = te.get_batch(torch.arange(len(te)))
    flat_tr = {tuple(r.tolist()) for r in x.flatten(1)}
    assert not any(tuple(r.tolist()) in flat_tr for r in xt.flatten(1)[:50])
    assert build_dataset("digits", "val").get_batch([0])[1] == te.get_batch([0])[1]


def test_digits_resize():
    ds = build_dataset("digits", "test", img_size=16)
    assert ds.img_size == (16, 16) and ds.get_batch([0, 1])[0].shape == (2, 1, 16, 16)


# ----------------------------------------------------------------------------- MNIST / IDX
def _write_idx(path: Path, arr: np.ndarray, gz: bool) -> None:
    header = bytes([0, 0, 8, arr.ndim]) + b"".join(int(s).to_bytes(4, "big") for s in arr.shape)
    data = header + arr.astype(np.uint8).tobytes()
    (gzip.open if gz else open)(path, "wb").write(data)


@pytest.mark.parametrize("gz", [False, True])
def test_idx_roundtrip_raw_and_gz(tmp_path, gz):
    arr = np.random.default_rng(0).integers(0, 256, size=(5, 3, 4), dtype=np.uint8)
    p = tmp_path / ("a.idx3-ubyte" + (".gz" if gz else ""))
    _write_idx(p, arr, gz)
    assert np.array_equal(read_idx(p), arr)


def test_idx_truncated_and_bad_magic(tmp_path):
    arr = np.zeros((4, 2, 2), dtype=np.uint8)
    p = tmp_path / "t.idx3-ubyte"
    _write_idx(p, arr, False)
    p.write_bytes(p.read_bytes()[:-3])
    with pytest.raises(ValueError, match="truncated"):
        read_idx(p)
    p.write_bytes(b"\x01\x02\x08\x01" + b"\x00" * 8)
    with pytest.raises(ValueError, match="magic"):
        read_idx(p)


def test_mnist_from_a_tiny_directory(tmp_path):
    rng = np.random.default_rng(1)
    for prefix, n in (("train", 12), ("t10k", 5)):
        _write_idx(tmp_path / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)), True)
        _write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, (n,)), False)
    tr = build_dataset("mnist", "train", data_dir=str(tmp_path))
    te = build_dataset("mnist", "test", data_dir=str(tmp_path), img_size=32)
    assert len(tr) == 12 and len(te) == 5
    assert te.get_batch([0])[0].shape == (1, 1, 32, 32)


def test_mnist_missing_directory_and_files(tmp_path):
    with pytest.raises(ValueError, match="needs a data directory"):
        build_dataset("mnist", "train")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_dataset("mnist", "train", data_dir=str(tmp_path / "nope"))
    (tmp_path / "a_file").write_text("not a directory")
    with pytest.raises(FileNotFoundError, match="'.*a_file' is not a directory"):  # said "does not exist"
        build_dataset("mnist", "train", data_dir=str(tmp_path / "a_file"))
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        build_dataset("mnist", "train", data_dir=str(tmp_path))


def test_mnist_real_copy(data_dir):
    mnist_dir = _existing(data_dir / "mnist")
    te = build_dataset("mnist", "test", data_dir=str(mnist_dir))
    assert len(te) == 10000
    x, y = te.get_batch(torch.arange(5))
    assert x.shape == (5, 1, 28, 28)
    assert y.tolist() == [7, 2, 1, 0, 4]  # the well-known first test labels
    tr = build_dataset("mnist", "train", data_dir=str(mnist_dir), limit=1000)
    assert len(tr) == 1000 and tr.get_batch([0])[1].item() == 5


# ----------------------------------------------------------------------------- image folder
def _make_folder(root: Path, classes, n, size=(10, 12), mode="RGB"):
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in classes:
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            shape = (size[1], size[0], 3) if mode == "RGB" else (size[1], size[0])
            Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode).save(root / c / f"{i}.png")


def test_image_folder_split_folders(tmp_path):
    pytest.importorskip("PIL")
    _make_folder(tmp_path / "train", ["cat", "dog"], 3)
    _make_folder(tmp_path / "val", ["dog"], 2)  # a split missing a class keeps the global labels
    tr = build_dataset("image-folder", "train", data_dir=str(tmp_path), img_size=8)
    te = build_dataset("image-folder", "test", data_dir=str(tmp_path), img_size=8)
    assert tr.classes == ["cat", "dog"] and len(tr) == 6 and tr.num_classes == 2
    assert te.labels.tolist() == [1, 1]
    x, y = tr.get_batch(torch.tensor([0, 5]))
    assert x.shape == (2, 3, 8, 8) and y.tolist() == [0, 1]


def test_image_folder_flat_layout_grey_and_errors(tmp_path):
    pytest.importorskip("PIL")
    _make_folder(tmp_path / "data", ["a", "b", "c"], 5, mode="L")
    kw = dict(data_dir=str(tmp_path / "data"), img_size=(6, 4), in_chans=1)
    tr, te = build_dataset("image-folder", "train", **kw), build_dataset("image-folder", "test", **kw)
    assert len(tr) + len(te) == 15 and len(te) == 3
    assert tr.get_batch([0])[0].shape == (1, 1, 6, 4)
    pre = build_dataset("image-folder", "train", preload=True, **kw)
    assert torch.equal(pre.get_batch([1, 2])[0], tr.get_batch([1, 2])[0])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no class subfolders"):
        build_dataset("image-folder", data_dir=str(tmp_path / "empty"))


# ----------------------------------------------------------------------------- subspaces
def test_subspace_bases_are_orthonormal_and_mutually_orthogonal():
    U = subspace_bases(32, 4, 6, seed=3)
    G = torch.einsum("kdp,jdq->kjpq", U, U)
    for k in range(4):
        for j in range(4):
            want = torch.eye(6, dtype=U.dtype) if k == j else torch.zeros(6, 6, dtype=U.dtype)
            assert torch.allclose(G[k, j], want, atol=1e-10)
    with pytest.raises(ValueError, match="must be <= dim"):
        subspace_bases(10, 3, 4)


def test_subspace_samples_lie_in_their_subspace():
    U = subspace_bases(32, 4, 6, seed=0)
    z, y = sample_subspaces(U, 40, active=3, seed=1)
    assert y.tolist() == [i % 4 for i in range(40)]
    for i in range(40):
        Uk = U[y[i]]
        resid = z[i] - Uk @ (Uk.T @ z[i])
        assert resid.norm() < 1e-10 * max(1.0, z[i].norm().item())
        other = U[(y[i] + 1) % 4]
        assert (other.T @ z[i]).norm() < 1e-10


def test_subspaces_dataset_layouts():
    ds = build_dataset("subspaces", "train", num_train=20)
    assert ds.kind == "image" and ds.get_batch(torch.arange(4))[0].shape == (4, 1, 8, 8) and ds.num_classes == 4
    vec = build_dataset("subspaces", "test", layout="vector", num_test=10)
    assert vec.get_batch([0, 1])[0].shape == (2, 64)
    a = build_dataset("subspaces", "train", num_train=10).get_batch(torch.arange(10))[0]
    b = build_dataset("subspaces", "test", num_test=10).get_batch(torch.arange(10))[0]
    assert not torch.allclose(a, b)
    with pytest.raises(ValueError, match="perfect square"):
        build_dataset("subspaces", dim=60, subspace_dim=10)


# ----------------------------------------------------------------------------- text
def test_default_corpus_and_vocab():
    tr, va = build_dataset("text", "train"), build_dataset("text", "val")
    assert tr.vocab.chars == va.vocab.chars and tr.vocab_size == len(set(tr.vocab.chars))
    text = (Path(__file__).parents[3] / "src/whiteformer/app/data/corpus/shakespeare_small.txt").read_text()
    assert 200_000 < len(text) < 400_000
    assert tr.vocab.decode(torch.cat([tr.tokens, va.tokens])) == text
    assert len(va) == len(text) - int(len(text) * 0.9)
    x, y = tr.get_windows(torch.tensor([0, 100]), 16)
    assert x.shape == (2, 16) and torch.equal(x[:, 1:], y[:, :-1])
    assert tr.vocab.decode(x[0]) == text[:16]
    assert torch.equal(tr.vocab.encode("KING"), torch.tensor([tr.vocab.stoi[c] for c in "KING"]))
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tr.vocab.encode("\u00e9")
    assert build_dataset("text", "test").tokens.shape == va.tokens.shape


def test_text_reads_xz_and_gz(tmp_path):
    body = "to be or not to be, that is the question\n" * 10
    (tmp_path / "a.txt").write_text(body)
    with lzma.open(tmp_path / "a.txt.xz", "wt") as f:
        f.write(body)
    with gzip.open(tmp_path / "a.txt.gz", "wt") as f:
        f.write(body)
    ref = build_dataset("text", "train", path=str(tmp_path / "a.txt")).tokens
    for name in ("a.txt.xz", "a.txt.gz"):
        assert torch.equal(build_dataset("text", "train", data_dir=str(tmp_path / name)).tokens, ref)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_dataset("text", path=str(tmp_path / "missing.txt"))
    with pytest.raises(FileNotFoundError, match="'/dev/zero' is not a regular file"):  # said "does not exist"
        build_dataset("text", path="/dev/zero")
    with pytest.raises(ValueError, match="is a directory"):
        build_dataset("text", data_dir=str(tmp_path))


def test_text_full_corpus(data_dir):
    corpus = _existing(data_dir / "shakespeare" / "complete_works.txt.xz")
    va = build_dataset("text", "val", path=str(corpus))
    assert len(va) == 5057282 - int(5057282 * 0.9)


# ----------------------------------------------------------------------------- ListOps
@pytest.mark.parametrize("expr,value", [
    ("[MAX 2 9 [MIN 4 7 ] 0 ]", 9),
    ("[MIN 3 [MAX 1 0 ] 5 ]", 1),
    ("[MED 1 2 3 4 ]", 2),       # int(median) of an even list: (2 + 3) // 2
    ("[MED 7 1 5 ]", 5),
    ("[SM 5 6 7 ]", 8),          # (5 + 6 + 7) mod 10
    ("[SM [MAX 9 9 ] [MED 3 8 ] 4 ]", 8),  # 9 + 5 + 4 = 18
    ("( ( [MAX 2 ) 9 ) ]", 9),   # LRA's parenthesised text form
])
def test_listops_evaluation(expr, value):
    assert evaluate(tokenize(expr)) == value


def test_listops_generator_respects_grammar_and_lengths():
    import random

    rng = random.Random(0)
    for _ in range(30):
        toks, value = generate_expression(rng, 10, 60, max_depth=4, max_args=5)
        assert 10 <= len(toks) <= 60
        assert evaluate(toks) == value
        assert toks[0].startswith("[") and toks[-1] == "]"
        depth = max_depth = 0
        for t in toks:
            depth += t.startswith("[")
            depth -= t == "]"
            max_depth = max(max_depth, depth)
        assert max_depth <= 4 - 1 + 1


def test_listops_dataset():
    ds = build_dataset("listops", "train", num_train=40, min_length=8, max_length=48, max_depth=4, seed=1)
    assert ds.tokens.shape == (40, 48) and ds.vocab == VOCAB
    for i in range(40):
        n = int(ds.lengths[i])
        assert 8 <= n <= 48 and torch.all(ds.tokens[i, n:] == 0) and torch.all(ds.tokens[i, :n] != 0)
        assert evaluate([VOCAB[t] for t in ds.tokens[i, :n].tolist()]) == int(ds.labels[i])
    again = build_dataset("listops", "train", num_train=40, min_length=8, max_length=48, max_depth=4, seed=1)
    assert torch.equal(again.tokens, ds.tokens)
    test = build_dataset("listops", "test", num_test=40, min_length=8, max_length=48, max_depth=4, seed=1)
    assert not torch.equal(test.tokens, ds.tokens)
    with pytest.raises(ValueError, match="min_length <= max_length"):
        build_dataset("listops", min_length=10, max_length=5)
    assert statistics.pstdev(ds.labels.tolist()) > 0


# ----------------------------------------------------------------------------- augmentation
def test_translate_matches_a_loop():
    x = torch.randn(6, 2, 5, 7)
    shifts = torch.tensor([[0, 0], [1, -2], [-2, 1], [2, 2], [-1, 0], [0, 2]])
    out = translate(x, shifts, 2)
    ref = torch.zeros_like(x)
    for b in range(6):
        dy, dx = shifts[b].tolist()
        for i in range(5):
            for j in range(7):
                si, sj = i - dy, j - dx
                if 0 <= si < 5 and 0 <= sj < 7:
                    ref[b, :, i, j] = x[b, :, si, sj]
    assert torch.equal(out, ref)


def test_augment_is_reproducible_and_sliceable():
    aug = Augment(translate=1, flip=0.5)
    x = torch.rand(8, 1, 6, 6)
    p1 = aug.sample(8, torch.Generator().manual_seed(3))
    p2 = aug.sample(8, torch.Generator().manual_seed(3))
    assert all(torch.equal(p1[k], p2[k]) for k in p1)
    full = aug.apply(x, p1)
    assert torch.equal(aug.apply(x[4:], p1, slice(4, 8)), full[4:])
    m = torch.tensor([True, False])
    assert torch.equal(hflip(x[:2], m)[0], x[0].flip(-1)) and torch.equal(hflip(x[:2], m)[1], x[1])
    with pytest.raises(ValueError, match="translate"):
        Augment(translate=-1)


def test_docstring_table_lists_every_registered_dataset_with_its_help():
    """The table of whiteformer.app.data's docstring and `whiteformer list-datasets` say what the registry holds."""
    import re

    import whiteformer.app.data as data

    rows = dict(re.findall(r"^``([\w-]+)``\s+(.+)$", data.__doc__, flags=re.M))
    assert sorted(rows) == data.list_datasets()
    for name, text in rows.items():
        assert data.dataset_info(name)["help"] == text.strip(), name


def test_build_dataset_alone_checks_what_a_dataset_reads(tmp_path):
    from whiteformer.app.data import check_dataset_args, dataset_info

    assert [n for n in list_datasets() if dataset_info(n)["reads"] == "directory"] == \
        ["image-folder", "mnist", "mnist-pixels", "tokens"]
    with pytest.raises(TypeError, match="'digits' does not read files"):
        build_dataset("digits", data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="'mnist-pixels' needs a data directory"):
        build_dataset("mnist-pixels")
    with pytest.raises(FileNotFoundError, match="corpus file .* does not exist"):
        check_dataset_args("shakespeare-plays", data_dir=str(tmp_path / "missing.txt"))
    assert "img_size" in dataset_info("digits")["arguments"] and "split" not in dataset_info("digits")["arguments"]


def test_data_kinds_named_in_base_are_the_task_kinds():
    import whiteformer.app.data.base as base
    from whiteformer.app.train.tasks import TASKS

    for kind in TASKS.list():
        assert f'"{kind}"' in base.__doc__.split("Batches are fetched")[0], kind
