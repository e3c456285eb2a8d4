"""The ``tokens`` dataset: nanoGPT's train.bin / val.bin memmaps, meta.json, the checks at the door,
and reads that touch only the windows of a batch."""
import json
import resource

import numpy as np
import pytest
import torch

from whiteformer.app.data import build_dataset
from whiteformer.app.data.tokens import SAMPLE_TOKENS, TokenFileError


def _write(d, train, val, meta=None, dtype=np.uint16):
    d.mkdir(parents=True, exist_ok=True)
    np.asarray(train, dtype=dtype).tofile(d / "train.bin")
    np.asarray(val, dtype=dtype).tofile(d / "val.bin")
    if meta is not None:
        (d / "meta.json").write_text(json.dumps(meta))
    return d


def test_windows_are_the_file_slices_and_targets_are_shifted_by_one(tmp_path):
    rng = np.random.default_rng(0)
    train, val = rng.integers(0, 1000, 5000), rng.integers(0, 1000, 700)
    d = _write(tmp_path / "d", train, val, {"vocab_size": 1000, "eod_id": 7})
    ds = build_dataset("tokens", "train", data_dir=str(d))
    assert (ds.kind, len(ds), ds.vocab_size, ds.eod_id, ds.vocab) == ("lm", 5000, 1000, 7, None)
    x, y = ds.get_windows(torch.tensor([0, 17, 4999 - 16]), 16)
    assert x.dtype == torch.int64 and x.shape == (3, 16)
    for row, s in enumerate([0, 17, 4983]):
        assert x[row].tolist() == train[s:s + 16].tolist() and y[row].tolist() == train[s + 1:s + 17].tolist()
    ev = build_dataset("tokens", "test", data_dir=str(d))  # "test" is the val split, as for text
    assert len(ev) == 700 and ev.name == "tokens/val"


def test_uint32_files_and_vocab_size_from_the_arguments(tmp_path):
    ids = np.arange(70000, 71000)
    d = _write(tmp_path / "d", ids, ids[:100], dtype=np.uint32)
    ds = build_dataset("tokens", "train", data_dir=str(d), dtype="uint32", vocab_size=100000)
    assert len(ds) == 1000 and ds.get_windows(torch.tensor([5]), 3)[0].tolist() == [[70005, 70006, 70007]]
    # read as uint16 (the default), the same bytes are 2000 ids, most of them >= 1000: refused
    with pytest.raises(TokenFileError, match="not below the vocabulary size 1000"):
        build_dataset("tokens", "train", data_dir=str(d), vocab_size=1000)


@pytest.mark.parametrize("meta, kwargs, match", [
    (None, {}, "vocabulary size is unknown.*data_args.vocab_size"),
    ({"vocab_size": 500}, {"vocab_size": 400}, "smaller than the vocabulary"),
    ({"vocab_size": 500, "dtype": "uint32"}, {"dtype": "uint16"}, "data_args.dtype=uint16 but .* says uint32"),
    ({"vocab_size": 500}, {"dtype": "int8"}, "dtype must be one of"),
    ({"vocab_size": 70000}, {}, "does not fit uint16"),
    ({"vocab_size": "many"}, {}, "vocab_size must be a positive integer"),
    ([1, 2], {}, "must hold a JSON object"),
])
def test_the_vocabulary_and_dtype_are_checked_at_the_door(tmp_path, meta, kwargs, match):
    d = _write(tmp_path / "d", np.arange(100), np.arange(100), meta)
    with pytest.raises(ValueError, match=match):
        build_dataset("tokens", "train", data_dir=str(d), **kwargs)


def test_files_that_are_missing_short_or_not_whole_tokens_are_named(tmp_path):
    d = _write(tmp_path / "d", np.arange(100), np.arange(100), {"vocab_size": 100})
    (d / "val.bin").unlink()
    with pytest.raises(FileNotFoundError, match="val.bin' does not exist"):
        build_dataset("tokens", "val", data_dir=str(d))
    (d / "val.bin").write_bytes(b"\x01\x00\x02")  # 3 bytes: not a whole number of uint16 tokens
    with pytest.raises(TokenFileError, match="3 bytes, not a whole number of uint16"):
        build_dataset("tokens", "val", data_dir=str(d))
    (d / "val.bin").write_bytes(b"\x01\x00")
    with pytest.raises(TokenFileError, match="holds 1 token"):
        build_dataset("tokens", "val", data_dir=str(d))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_dataset("tokens", "train", data_dir=str(tmp_path / "nowhere"))


def test_an_id_outside_the_sample_is_caught_by_the_batch_that_reads_it(tmp_path):
    n = 64 * SAMPLE_TOKENS * 4  # the door's sample covers a quarter of this file
    ids = np.zeros(n, dtype=np.uint16)
    bad = SAMPLE_TOKENS + 123  # between the first two sampled runs
    ids[bad] = 999
    d = _write(tmp_path / "d", ids, ids[:100], {"vocab_size": 50})
    ds = build_dataset("tokens", "train", data_dir=str(d))  # the sample misses it
    assert ds.get_windows(torch.tensor([0, bad + 1]), 8)[0].max() == 0
    with pytest.raises(TokenFileError, match=f"token {bad} has id 999, not below the vocabulary size 50"):
        ds.get_windows(torch.tensor([0, bad - 3]), 8)


def test_a_file_far_larger_than_memory_is_read_only_where_the_windows_are(tmp_path):
    """A 1 TiB sparse train.bin (more than this machine's memory and disk) opens and serves batches
    spread over the whole file; the pages faulted in while doing so are counted by the kernel: a
    read of the whole file would fault at least 2**40 / 2 MiB (the largest page) = 524288 times."""
    d = tmp_path / "big"
    d.mkdir()
    try:
        with open(d / "train.bin", "wb") as f:
            f.truncate(1 << 40)
    except OSError as err:  # a file system without sparse files this large
        pytest.skip(f"cannot make a 1 TiB sparse file here: {err}")
    np.arange(100, dtype=np.uint16).tofile(d / "val.bin")
    (d / "meta.json").write_text(json.dumps({"vocab_size": 256}))

    def faults():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_minflt + r.ru_majflt

    before = faults()
    ds = build_dataset("tokens", "train", data_dir=str(d))
    assert len(ds) == 1 << 39
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        starts = torch.randint(0, len(ds) - 129, (8,), generator=g)
        x, y = ds.get_windows(starts, 128)
        assert x.shape == (8, 128) and int(x.max()) == 0
    x, _ = ds.get_windows(torch.tensor([len(ds) - 129]), 128)  # the very end of the file
    assert x.shape == (1, 128)
    assert faults() - before < 20000


def test_nanogpt_meta_pkl_is_named_and_not_unpickled(tmp_path):
    d = _write(tmp_path / "d", np.arange(100), np.arange(100))
    (d / "meta.pkl").write_bytes(b"not a pickle: never read")
    with pytest.raises(ValueError, match=r"meta.pkl' \(nanoGPT's pickle\) is not read.*data_args.vocab_size=V"):
        build_dataset("tokens", "train", data_dir=str(d))
    assert len(build_dataset("tokens", "train", data_dir=str(d), vocab_size=100)) == 100


def test_a_given_tokenizer_decodes_the_ids_and_must_fit_the_vocabulary(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    words = ["<|endoftext|>", "a", "b", "c"]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="a"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(tmp_path / "tok.json"))
    d = _write(tmp_path / "d", [1, 2, 3, 0, 3, 2, 1, 0] * 10, [1, 2, 0] * 10, {"vocab_size": 8})
    ds = build_dataset("tokens", "train", data_dir=str(d), tokenizer=str(tmp_path / "tok.json"))
    assert ds.vocab.decode(ds.get_windows(torch.tensor([0]), 3)[0][0]) == "a b c" and ds.vocab.eod_id == 0
    with pytest.raises(ValueError, match="has 4 tokens, more than the vocabulary size 3"):
        build_dataset("tokens", "train", data_dir=str(_write(tmp_path / "d3", [1, 2, 0] * 9, [1, 2, 0])),
                      tokenizer=str(tmp_path / "tok.json"), vocab_size=3)


# ----------------------------------------------------------------------------- meta.json and the files
@pytest.mark.parametrize("written, said", [(np.uint32, "uint16"), (np.uint16, "uint32")])
@pytest.mark.parametrize("n", [100, 4096, 70001])
def test_a_file_of_another_dtype_than_meta_json_says_is_refused_naming_both(tmp_path, written, said, n):
    """A uint32 train.bin under a meta.json saying uint16 was read with every other id 0 (its size
    is a whole number of uint16 tokens, all below the vocabulary), though train_tokens said half."""
    ids = np.arange(n) % 50
    d = _write(tmp_path / "d", ids, ids[:10], {"vocab_size": 50, "dtype": said, "train_tokens": n,
                                               "val_tokens": 10}, dtype=written)
    if written == np.uint16 and n % 2:  # an odd uint16 count is no whole number of uint32 tokens
        with pytest.raises(TokenFileError, match="not a whole number"):
            build_dataset("tokens", "train", data_dir=str(d))
        return
    with pytest.raises(TokenFileError, match=f"train.bin' holds .* but .*meta.json' says train_tokens = {n}.*"
                                             f"was it written as {np.dtype(written).name}"):
        build_dataset("tokens", "train", data_dir=str(d))


@pytest.mark.parametrize("count", [0, 99, 101, "100", -1, 1.5])
def test_a_token_count_in_meta_json_must_be_the_files(tmp_path, count):
    d = _write(tmp_path / "d", np.arange(100), np.arange(10), {"vocab_size": 100, "train_tokens": count})
    with pytest.raises(ValueError, match="train_tokens"):
        build_dataset("tokens", "train", data_dir=str(d))
    assert len(build_dataset("tokens", "val", data_dir=str(d))) == 10  # (val_tokens not given: not checked)


@pytest.mark.parametrize("eod", ["x", 1.5, -1, 100, True, [0], {"id": 3}])
def test_an_eod_id_in_meta_json_that_is_no_token_id_is_refused(tmp_path, eod):
    """eod_id "x" was silently ignored (packed runs then had no end-of-document token)."""
    d = _write(tmp_path / "d", np.arange(100), np.arange(100), {"vocab_size": 100, "eod_id": eod})
    for kw in ({}, {"pack": True}):
        with pytest.raises(ValueError, match=r"meta.json': eod_id must be a token id in \[0, 99\]"):
            build_dataset("tokens", "train", data_dir=str(d), **kw)


@pytest.mark.parametrize("depth", [101, 100_000])
def test_a_deeply_nested_meta_json_is_refused(tmp_path, depth):
    """A RecursionError in read_meta."""
    d = _write(tmp_path / "d", np.arange(100), np.arange(100))
    (d / "meta.json").write_text('{"vocab_size": 100, "x": ' + "[" * depth + "]" * depth + "}")
    with pytest.raises(ValueError, match="meta.json' nests lists or mappings more than 100 levels deep"):
        build_dataset("tokens", "train", data_dir=str(d))


def test_a_file_larger_than_the_address_space_serves_windows(tmp_path):
    """A 1 TiB token file under an address-space limit failed with a bare "Cannot allocate memory":
    it was mapped whole. Each window is read on its own, so the limit never comes near."""
    import subprocess
    import sys
    import textwrap

    d = tmp_path / "big"
    d.mkdir()
    try:
        with open(d / "train.bin", "wb") as f:
            f.truncate(1 << 40)
    except OSError as err:
        pytest.skip(f"cannot make a 1 TiB sparse file here: {err}")
    np.arange(100, dtype=np.uint16).tofile(d / "val.bin")
    (d / "meta.json").write_text(json.dumps({"vocab_size": 256}))
    script = textwrap.dedent(f"""
        import resource, torch
        from whiteformer.app.data import build_dataset
        vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), resource.RLIM_INFINITY))  # 2 GiB to spare
        ds = build_dataset("tokens", "train", data_dir={str(d)!r})
        x, y = ds.get_windows(torch.tensor([0, len(ds) // 2, len(ds) - 129]), 128)
        print(tuple(x.shape), int(x.max()))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.split() == ["(3,", "128)", "0"], res.stderr[-2000:]
