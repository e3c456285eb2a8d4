"""Packed documents on the data side: windows of a token stream split after each end-of-document
token into the one row of ``cu_seqlens`` documents the language models read, targets that never
cross a boundary, and the ``text`` dataset's ``pack`` / ``eod`` / ``eod_id`` options."""
import json

import numpy as np
import pytest
import torch

from whiteformer.app.data import build_dataset
from whiteformer.app.data.packing import PackedWindows, pack_windows

EOD = 0


def _documents(packed: PackedWindows):
    bounds = packed.cu_seqlens.tolist()
    return [packed.idx[0, a:b] for a, b in zip(bounds, bounds[1:])]


def test_pack_windows_splits_after_each_end_and_at_each_window_end():
    stream = torch.tensor([7, 5, 1, 0, 2, 3, 0, 0, 4, 4, 4, 0, 1, 6])
    starts = torch.tensor([1, 6])
    offs = starts[:, None] + torch.arange(7)
    x, y = stream[offs[:, :-1]], stream[offs[:, 1:]]  # windows of 6 and their next tokens
    packed, targets = pack_windows(x, y, EOD)
    assert packed.idx.shape == targets.shape == (1, 12)
    assert torch.equal(packed.idx[0], x.reshape(-1))
    assert packed.cu_seqlens.dtype == torch.int32
    # window 0 = [5 1 0 | 2 3 0], window 1 = [0 | 0 | 4 4 4 0]
    assert packed.cu_seqlens.tolist() == [0, 3, 6, 7, 8, 12]
    for doc in _documents(packed)[:-1]:
        assert doc[-1] == EOD  # every document keeps its end token
    # every token predicts the next token of its own document; a document's last token predicts nothing
    assert targets[0].tolist() == [1, 0, -1, 3, 0, -1, -1, -1, 4, 4, 0, -1]


def test_pack_windows_targets_stay_inside_documents():
    g = torch.Generator().manual_seed(0)
    stream = torch.randint(0, 4, (400,), generator=g)  # EOD about once in 4 tokens, runs of them too
    starts = torch.randint(0, 400 - 17, (5,), generator=g)
    offs = starts[:, None] + torch.arange(17)
    x, y = stream[offs[:, :-1]], stream[offs[:, 1:]]
    packed, targets = pack_windows(x, y, EOD)
    bounds = packed.cu_seqlens.tolist()
    assert bounds[0] == 0 and bounds[-1] == 80 and all(b > a for a, b in zip(bounds, bounds[1:]))
    assert set(range(16, 81, 16)) <= set(bounds)  # every window boundary is a document boundary
    for a, b in zip(bounds, bounds[1:]):
        doc, t = packed.idx[0, a:b], targets[0, a:b]
        assert torch.equal(t[:-1], doc[1:]) and t[-1] == -1
        assert not bool((doc[:-1] == EOD).any())  # an end token only ends a document


def test_text_pack_options(tmp_path):
    path = tmp_path / "docs.txt"
    path.write_text("".join(f"document {i} says {'la' * (i % 7)}\n" for i in range(40)))
    ds = build_dataset("text", "train", path=str(path), pack=True, eod="\n")
    assert ds.pack and ds.eod_id == ds.vocab.stoi["\n"] == 0
    assert build_dataset("text", "val", path=str(path), pack=True, eod_id=3).eod_id == 3
    plain = build_dataset("text", "train", path=str(path))
    assert not plain.pack and plain.eod_id is None
    with pytest.raises(ValueError, match="pack=true needs an end-of-document token: give data_args.eod_id"):
        build_dataset("text", path=str(path), pack=True)
    with pytest.raises(ValueError, match=r"eod='\\t' is not in the vocabulary"):
        build_dataset("text", path=str(path), pack=True, eod="\t")
    with pytest.raises(ValueError, match="as eod_id or eod, not both"):
        build_dataset("text", path=str(path), pack=True, eod="\n", eod_id=0)
    with pytest.raises(ValueError, match=r"eod_id must be a token id in \[0, "):
        build_dataset("text", path=str(path), pack=True, eod_id=plain.vocab_size)
    with pytest.raises(ValueError, match="eod_id must be (a token id|an integer)"):
        build_dataset("text", path=str(path), pack=True, eod_id=True)
    with pytest.raises(TypeError, match="pack must be true or false"):
        build_dataset("text", path=str(path), pack="yes", eod="\n")


def test_text_pack_with_a_trained_tokenizer_ends_documents_at_its_eod_token(tmp_path):
    pytest.importorskip("tokenizers")
    path = tmp_path / "docs.txt"
    path.write_text("".join(f"document {i} says {'la' * (i % 7)}<|endoftext|>" for i in range(60)))
    ds = build_dataset("text", "train", path=str(path), train_tokenizer=280, pack=True)
    assert ds.pack and ds.eod_id == ds.vocab.eod_id == ds.vocab.token_to_id("<|endoftext|>")
    assert int((ds.tokens == ds.eod_id).sum()) >= 50  # one token per document end
    assert build_dataset("text", "train", path=str(path), train_tokenizer=280, pack=True,
                         eod="<|endoftext|>").eod_id == ds.eod_id
    path.write_text(path.read_text() + "Z")  # a character of the validation split only
    with pytest.warns(UserWarning, match="'Z' .* never occurs in the train split"):
        build_dataset("text", "train", path=str(path), pack=True, eod="Z")


def test_tokens_pack_takes_the_eod_id_of_meta_json(tmp_path):
    d = tmp_path / "tok"
    d.mkdir()
    np.asarray([1, 2, 0, 3, 0] * 20, dtype=np.uint16).tofile(d / "train.bin")
    np.asarray([4, 0] * 20, dtype=np.uint16).tofile(d / "val.bin")
    (d / "meta.json").write_text(json.dumps({"vocab_size": 8, "eod_id": 0}))
    ds = build_dataset("tokens", "train", data_dir=str(d), pack=True)
    assert ds.pack and ds.eod_id == 0
    assert build_dataset("tokens", "val", data_dir=str(d), pack=True, eod_id=4).eod_id == 4
    assert not build_dataset("tokens", "train", data_dir=str(d)).pack
    (d / "meta.json").write_text(json.dumps({"vocab_size": 8}))
    with pytest.raises(ValueError, match="tokens: pack=true needs an end-of-document token"):
        build_dataset("tokens", data_dir=str(d), pack=True)
    with pytest.raises(ValueError, match=r"eod_id must be a token id in \[0, 7\]"):
        build_dataset("tokens", data_dir=str(d), pack=True, eod_id=8)
