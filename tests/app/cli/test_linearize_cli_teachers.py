"""``whiteformer linearize`` on a GPT-2 folder (token data) and on a ViT folder (MNIST's IDX files)."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import whiteformer
from test_cli_errors import _one_error_line
from test_linearize_cli import STEPS, VOCAB, _tokens_dir, greedy_in_transformers
from whiteformer.app.cli import main
from whiteformer.attention.tssa import TSSA
from whiteformer.models.hybrid_lm import HybridGPTLM
from whiteformer.ops.causal_tssa.state import CausalTSSAState

transformers = pytest.importorskip("transformers")


def _write_idx(path: Path, arr: np.ndarray) -> None:
    """An IDX file of unsigned bytes (MNIST's format)."""
    header = bytes([0, 0, 8, arr.ndim]) + b"".join(int(s).to_bytes(4, "big") for s in arr.shape)
    path.write_bytes(header + arr.astype(np.uint8).tobytes())


def _mnist_dir(d: Path) -> Path:
    """A few MNIST-shaped images: a bright square in the quadrant of the label (0-3)."""
    d.mkdir()
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 64), ("t10k", 16)):
        labels = rng.integers(0, 4, n)
        images = rng.integers(0, 60, (n, 28, 28))
        for k, label in enumerate(labels):
            r, c = divmod(int(label), 2)
            images[k, r * 14 + 3:r * 14 + 11, c * 14 + 3:c * 14 + 11] = 255
        _write_idx(d / f"{prefix}-images-idx3-ubyte", images)
        _write_idx(d / f"{prefix}-labels-idx1-ubyte", labels)
    return d


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    torch.manual_seed(0)
    gpt = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                  bos_token_id=0, eos_token_id=VOCAB - 1)
    transformers.GPT2LMHeadModel(gpt).save_pretrained(root / "gpt2")
    vit = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=1, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=64, num_labels=10)
    transformers.ViTForImageClassification(vit).save_pretrained(root / "vit")
    return {"gpt2": root / "gpt2", "vit": root / "vit", "tokens": _tokens_dir(root / "tokens"),
            "mnist": _mnist_dir(root / "mnist")}


def _argv(teacher, dataset, data, out, *extra):
    return ["linearize", "--teacher", str(teacher), "--dataset", dataset, "--data-dir", str(data), "--out", str(out),
            *STEPS, *extra]


def test_gpt2_folder_loads_in_a_process_that_imports_only_transformers(folders, tmp_path):
    out = tmp_path / "student"
    assert main(_argv(folders["gpt2"], "tokens", folders["tokens"], out, "--keep-softmax", "1")) == 0
    model = whiteformer.from_pretrained(out).eval()
    assert isinstance(model, HybridGPTLM) and model.keep_softmax == [1]
    assert model.eos_token_id == VOCAB - 1  # the teacher's, from its config
    assert model.init_kwargs["mlp_act"] == "gelu_tanh" and model.bias
    for n in (4, 40):  # the TSSA layer's state keeps its size, the kept softmax layer's cache grows
        _, state = model.prefill(torch.randint(0, VOCAB, (1, n)))
        assert isinstance(state.layers[0], CausalTSSAState) and not isinstance(state.layers[1], CausalTSSAState)
    prompt = [[3, 4, 5, 3, 4, 5, 3]]
    ref = model.generate(torch.tensor(prompt), max_new_tokens=6, temperature=0, ignore_eos=True)
    assert greedy_in_transformers(out, prompt, 6, tmp_path) == str(ref.tolist())


def test_vit_folder_and_mnist(folders, tmp_path):
    out = tmp_path / "student"
    assert main(_argv(folders["vit"], "mnist", folders["mnist"], out, "--finetune-steps", "2")) == 0
    model = whiteformer.from_pretrained(out).eval()
    assert all(isinstance(b.attn, TSSA) for b in model.blocks)
    report = json.loads((out / "linearize.json").read_text())
    assert report["dataset"] == "mnist" and report["tssa_layers"] == [0, 1]
    assert all(a == a for a in (report["kl_swap"], report["kl_finetune"]))
    assert model(torch.zeros(2, 1, 16, 16)).shape == (2, 10)  # the teacher's image size: MNIST was resized


@pytest.mark.parametrize("teacher, dataset, data, needle", [  # (said before the data are read)
    ("gpt2", "mnist", "tokens", "an image data set, but the teacher is a language model"),
    ("vit", "tokens", "mnist", "a token data set, but the teacher is an image classifier"),
])
def test_data_of_the_other_kind_is_one_error_line(folders, tmp_path, capsys, teacher, dataset, data, needle):
    out = tmp_path / "student"
    assert main(_argv(folders[teacher], dataset, folders[data], out)) == 2
    _one_error_line(capsys, needle)
    assert not out.exists()


def test_images_that_do_not_fit_the_teacher_are_one_error_line(folders, tmp_path, capsys):
    three = tmp_path / "rgb"
    vit = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=1,
                                 num_attention_heads=4, intermediate_size=64, num_labels=10)
    transformers.ViTForImageClassification(vit).save_pretrained(three)
    capsys.readouterr()
    for teacher, extra, needle in ((three, [], "channel"), (folders["vit"], ["--pack"], "--pack")):
        assert main(_argv(teacher, "mnist", folders["mnist"], tmp_path / "student", *extra)) == 2
        _one_error_line(capsys, needle)
        assert not (tmp_path / "student").exists()
