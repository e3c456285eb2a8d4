"""Offline LRA stand-ins: Pathfinder generator, sequential MNIST pixels, Shakespeare plays / pairs,
long ListOps; and the learning-rate schedules of ToST Table 7."""
from __future__ import annotations

import gzip
import math
import random
import time
from collections import deque

import numpy as np
import pytest
import torch

from whiteformer.app.data import build_dataset
from whiteformer.app.data.listops import generate_expression
from whiteformer.app.data.pathfinder import generate_pathfinder
from whiteformer.app.data.plays import speeches, split_plays
from whiteformer.app.data.text import default_corpus_path, read_text
from whiteformer.app.schedule import lr_multiplier


# ----------------------------------------------------------------------------- Pathfinder
def _component(img: np.ndarray, start) -> set:
    """8-connected foreground pixels reachable from ``start`` (breadth-first search)."""
    h, w = img.shape
    seen, todo = {tuple(start)}, deque([tuple(start)])
    while todo:
        y, x = todo.popleft()
        for dy in (-1, 0, 1):
            for dx in (-1, 0, 1):
                q = (y + dy, x + dx)
                if 0 <= q[0] < h and 0 <= q[1] < w and img[q] and q not in seen:
                    seen.add(q)
                    todo.append(q)
    return seen


@pytest.mark.parametrize("size,length", [(32, 20), (16, 10)])
def test_pathfinder_label_is_connectivity(size, length):
    """Drawn solid (gap 0), the two dots are in one 8-connected component exactly when label = 1."""
    rng = np.random.default_rng(0)
    for i in range(20):
        label = i % 2
        img, paths = generate_pathfinder(rng, label, size, length, length // 2, 1, dash=1, gap=0)
        a, b = paths[0][0], (paths[0][-1] if label else paths[1][-1])
        assert img[tuple(a)] == 255 and img[tuple(b)] == 255
        assert (tuple(b) in _component(img > 0, a)) == bool(label)
        assert len(paths) == 3


def test_pathfinder_dataset_tokens_and_balance():
    tr = build_dataset("pathfinder", "train", num_train=40, num_test=10, seed=1)
    te = build_dataset("pathfinder", "test", num_train=40, num_test=10, seed=1)
    assert tr.tokens.shape == (40, 1024) and te.tokens.shape == (10, 1024)  # 32x32 -> 1024 tokens
    assert tr.label_counts().tolist() == [20, 20] and tr.pad_id is None
    assert set(tr.tokens.unique().tolist()) == {0, 255}
    # each image shows two dots (3x3 squares) and dashed paths with gaps
    img = tr.tokens[0].view(32, 32).numpy() > 0
    again = build_dataset("pathfinder", "train", num_train=40, num_test=10, seed=1)
    assert torch.equal(again.tokens, tr.tokens)  # deterministic in the seed
    other = build_dataset("pathfinder", "train", num_train=40, num_test=10, seed=2)
    assert not torch.equal(other.tokens, tr.tokens)
    assert img.sum() > 20


def test_pathfinder_dashes_have_gaps():
    rng = np.random.default_rng(3)
    dashed, paths = generate_pathfinder(rng, 1, 32, 20, 10, 0, dash=2, gap=1)
    on = dashed[paths[0][3:-3, 0], paths[0][3:-3, 1]]  # away from the dots
    assert (on == 0).any() and (on == 255).any()


def test_pathfinder_errors():
    with pytest.raises(ValueError, match="could not place"):
        generate_pathfinder(np.random.default_rng(0), 1, 8, 30, 30, 6, max_tries=2)
    with pytest.raises(ValueError, match="label"):
        generate_pathfinder(np.random.default_rng(0), 2)
    with pytest.raises(ValueError, match="img_size"):
        build_dataset("pathfinder", img_size=4)


# ----------------------------------------------------------------------------- sequential MNIST
def _write_idx(path, arr: np.ndarray) -> None:
    header = bytes([0, 0, 8, arr.ndim]) + b"".join(int(s).to_bytes(4, "big") for s in arr.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + arr.astype(np.uint8).tobytes())


def test_mnist_pixels_from_idx(tmp_path):
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 6), ("t10k", 3)):
        _write_idx(tmp_path / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        _write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", rng.integers(0, 10, (n,)))
    ds = build_dataset("mnist-pixels", "train", data_dir=str(tmp_path))
    img = build_dataset("mnist", "train", data_dir=str(tmp_path))
    assert ds.tokens.shape == (6, 784) and ds.vocab_size == 256 and ds.pad_id is None
    assert torch.equal(ds.tokens, img.data.reshape(6, -1).long())  # row-major pixel values
    assert torch.equal(ds.labels, img.labels)
    small = build_dataset("mnist-pixels", "test", data_dir=str(tmp_path), img_size=14, limit=2)
    assert small.tokens.shape == (2, 196) and int(small.tokens.max()) <= 255


# ----------------------------------------------------------------------------- Shakespeare
def _play_texts():
    return {t: "\n".join(speeches(body)) for t, body in split_plays(read_text(default_corpus_path()))}


def test_split_plays_and_speeches():
    plays = split_plays(read_text(default_corpus_path()))
    assert [t for t, _ in plays] == ["JULIUS CAESAR", "THE TRAGEDY OF KING LEAR"]
    jc = speeches(plays[0][1])
    assert len(jc) > 500
    assert jc[0].startswith("Hence! home, you idle creatures")  # FLAVIUS's first speech, name dropped
    assert not any(s.split("\n")[0] in ("FLAVIUS.", "BRUTUS.") for s in jc)


def test_shakespeare_plays_documents():
    ds = build_dataset("shakespeare-plays", "train", num_train=20, min_length=40, max_length=80)
    assert ds.classes == ["JULIUS CAESAR", "THE TRAGEDY OF KING LEAR"] and ds.label_counts().tolist() == [10, 10]
    assert ds.vocab_size == 257 and ds.pad_id == 0 and ds.tokens.shape == (20, 80)
    texts = _play_texts()
    titles = list(texts)
    for tok, n, y in zip(ds.tokens, ds.lengths, ds.labels):
        assert 40 <= n <= 80 and (tok[n:] == 0).all() and (tok[:n] > 0).all()
        doc = bytes((tok[:n] - 1).tolist()).decode()
        head = doc.split("\n")[0][:30]
        assert head in texts[titles[int(y)]]  # the document comes from its labelled play


def test_shakespeare_splits_share_no_speech():
    tr = build_dataset("shakespeare-plays", "train", num_train=200, min_length=200, max_length=200)
    te = build_dataset("shakespeare-plays", "test", num_test=50, min_length=200, max_length=200)
    train_text = "".join(bytes((t[:n] - 1).tolist()).decode() for t, n in zip(tr.tokens, tr.lengths))
    for t, n in zip(te.tokens, te.lengths):
        first = bytes((t[:n] - 1).tolist()).decode().split("\n")[0]
        if len(first) >= 60:  # long enough to be unique
            assert first not in train_text


def test_shakespeare_pairs():
    ds = build_dataset("shakespeare-pairs", "test", num_test=30, min_length=50, max_length=60)
    assert ds.tokens.shape == (30, 2, 60) and ds.lengths.shape == (30, 2) and ds.pair
    assert ds.label_counts().tolist() == [15, 15]
    texts = _play_texts()

    def play_of(tok, n):
        doc = bytes((tok[:n] - 1).tolist()).decode()  # consecutive speeches: a substring of one play
        found = [t for t, body in texts.items() if doc in body]
        assert len(found) == 1
        return found[0]

    for pair, ns, y in zip(ds.tokens, ds.lengths, ds.labels):
        assert (play_of(pair[0], ns[0]) == play_of(pair[1], ns[1])) == bool(y)


def test_plays_need_two_plays(tmp_path):
    one = tmp_path / "one.txt"
    one.write_text("HAMLET\n\nby William Shakespeare\n\nHAMLET.\nTo be.\n\n" * 1)
    with pytest.raises(ValueError, match="need at least 2"):
        build_dataset("shakespeare-plays", path=str(one))


# ----------------------------------------------------------------------------- ListOps at LRA length
def test_listops_reaches_lra_lengths():
    rng = random.Random(0)
    t0 = time.perf_counter()
    toks, _ = generate_expression(rng, min_length=500, max_length=2000, max_depth=10, max_args=10)
    assert 500 <= len(toks) <= 2000
    assert time.perf_counter() - t0 < 30


# ----------------------------------------------------------------------------- Table 7 schedules
def test_table7_schedules():
    total, warm = 100, 10
    for name in ("linear", "inverse_sqrt", "cosine"):
        ramp = [lr_multiplier(name, s, total, warm, 0.0) for s in range(warm)]
        assert ramp == pytest.approx([(s + 1) / warm for s in range(warm)])
    lin = [lr_multiplier("linear", s, total, warm, 0.0) for s in range(warm, total + 1)]
    assert lin[0] == pytest.approx(1.0) and lin[-1] == pytest.approx(0.0)
    assert all(a > b for a, b in zip(lin, lin[1:]))
    assert lr_multiplier("linear", 55, total, warm, 0.0) == pytest.approx(0.5)
    assert lr_multiplier("inverse_sqrt", 39, total, warm, 0.0) == pytest.approx(math.sqrt(10 / 40))
    assert lr_multiplier("inverse_sqrt", 10 ** 6, total, warm, 0.01) == pytest.approx(0.01)
    with pytest.raises(ValueError, match="schedule"):
        lr_multiplier("step", 0, total, warm, 0.0)
