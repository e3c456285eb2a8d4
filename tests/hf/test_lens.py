"""The white-box lens on any transformers model: layerwise_report / `whiteformer analyze layerwise`
on GPT-2, ViT and BERT built from configs, checked against an independent recomputation of the rates
from the hidden states."""
import copy
import json
import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install whiteformer[hf]")

import whiteformer  # noqa: E402
from whiteformer.analysis import coding_rate, layerwise_report  # noqa: E402
from whiteformer.analysis.report import COLUMNS  # noqa: E402


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=3, n_head=4, vocab_size=50, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2Model(config).eval()


def _vit():
    torch.manual_seed(0)
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                    image_size=32, patch_size=8, num_labels=3)
    return transformers.ViTForImageClassification(config).eval()


def _expected(states, eps, heads, keep=None):
    """(R, R_c(Z | head split)) per layer, recomputed sample by sample."""
    out = []
    for Z in states[1:]:
        R, Rc = [], []
        for b in range(Z.shape[0]):
            z = Z[b].double() if keep is None else Z[b][keep[b]].double()
            p = z.shape[-1] // heads
            R.append(float(coding_rate(z, eps)))
            Rc.append(sum(float(coding_rate(z[:, k * p:(k + 1) * p], eps)) for k in range(heads)))
        out.append((sum(R) / len(R), sum(Rc) / len(Rc)))
    return out


def _layer_outputs(model, x):
    """(hidden_states, the outputs of the layers 1..L): GPT-2 reports its last state after ln_f, so
    the last layer's own output comes from the same model with ln_f replaced by the identity."""
    with torch.no_grad():
        states = model(**{model.main_input_name: x, "output_hidden_states": True}).hidden_states
        if not hasattr(model, "ln_f"):
            return states, states[1:]
        plain = copy.deepcopy(model)
        plain.ln_f = torch.nn.Identity()
        return states, states[1:-1] + plain(x, output_hidden_states=True).hidden_states[-1:]


@pytest.mark.parametrize("make,inputs", [(_gpt2, lambda: torch.randint(0, 50, (3, 10))),
                                         (_vit, lambda: torch.randn(2, 3, 32, 32))], ids=["gpt2", "vit"])
def test_layerwise_report_on_a_transformers_model(tmp_path, make, inputs):
    model, x = make(), inputs()
    rep = layerwise_report(model, x, eps=0.5, out_dir=tmp_path)
    states, outputs = _layer_outputs(model, x)
    want = _expected((None, *outputs), 0.5, model.config.num_attention_heads)
    blocks = [row for row in rep.rows if row["layer"] is not None]
    assert len(blocks) == len(states) - 1 == model.config.num_hidden_layers
    assert [row["name"] for row in blocks] == [f"layer {i}" for i in range(1, len(blocks) + 1)]
    for row, (R, Rc) in zip(blocks, want):
        assert set(row) == set(COLUMNS) and row["R_c"] is None and row["R_c_var"] is None
        assert row["R"] == pytest.approx(R, rel=1e-9) and row["R_c_U"] == pytest.approx(Rc, rel=1e-9)
        assert row["delta_R_U"] == pytest.approx(R - Rc, rel=1e-9, abs=1e-9)
    assert len({row["R"] for row in rep.rows}) == len(rep.rows)  # the layers differ
    saved = json.loads((tmp_path / "layerwise_report.json").read_text())
    assert [r["R"] for r in saved["rows"]] == [r["R"] for r in rep.rows]
    assert (tmp_path / "layerwise_report.png").stat().st_size > 0
    two = layerwise_report(model, x, subspaces=2, plot=False)  # another subspace split
    assert two.rows[0]["heads"] == 2 and two.rows[0]["R"] == rep.rows[0]["R"]
    assert two.rows[0]["R_c_U"] != rep.rows[0]["R_c_U"]
    with pytest.raises(ValueError, match="subspaces"):
        layerwise_report(model, x, subspaces=5, plot=False)


def test_gpt2_final_norm_is_its_own_row(tmp_path):
    """GPT-2's hidden_states[-1] is ln_f of the last block's output: the lens shows it as a row named
    "final norm" after the blocks (no layer number), and the last block's row is the block's own
    output; with features="input" the final norm's input is that output."""
    model, x = _gpt2(), torch.randint(0, 50, (3, 10))
    states, outputs = _layer_outputs(model, x)
    rep = layerwise_report(model, x, eps=0.5, plot=False)
    assert [r["name"] for r in rep.rows] == ["layer 1", "layer 2", "layer 3", "final norm"]
    assert [r["layer"] for r in rep.rows] == [1, 2, 3, None]
    (final_R, final_Rc), = _expected((None, states[-1]), 0.5, 4)
    (last_R, _), = _expected((None, outputs[-1]), 0.5, 4)
    assert rep.rows[-1]["R"] == pytest.approx(final_R, rel=1e-9) and rep.rows[-1]["R_c_U"] == pytest.approx(final_Rc)
    assert rep.rows[2]["R"] == pytest.approx(last_R, rel=1e-9) and rep.rows[2]["R"] != pytest.approx(final_R)
    inputs = layerwise_report(model, x, eps=0.5, features="input", plot=False)
    assert [r["R"] for r in inputs.rows] == pytest.approx([r[0] for r in _expected((None, *states[:3], outputs[-1]),
                                                                                    0.5, 4)], rel=1e-9)
    assert "| - | final norm |" in rep.to_markdown()


def _figure_checks(rep, title, panels):
    fig = rep.figure()
    assert fig._suptitle.get_text() == title
    assert [ax.get_title() for ax in fig.axes] == panels
    for ax in fig.axes:  # every panel drawn and labelled
        assert ax.get_xlabel() == "layer" and ax.get_ylabel() and ax.lines
        assert not [t for t in ax.texts if "not available" in t.get_text()]
    return fig


def test_figure_of_a_saved_gpt2_has_its_name_labels_and_no_empty_panel(tmp_path, capsys):
    from whiteformer.app.cli import main

    _gpt2().save_pretrained(tmp_path / "tiny-gpt2")
    rep = layerwise_report(str(tmp_path / "tiny-gpt2"), torch.randint(0, 50, (2, 8)), plot=False)
    assert rep.model == "tiny-gpt2"  # the name, not the path
    fig = _figure_checks(rep, "tiny-gpt2", ["rates", "subspace compression"])
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert ticks == ["1", "2", "3", "final norm"]
    assert main(["analyze", "layerwise", "--checkpoint", str(tmp_path / "tiny-gpt2"), "--out", str(tmp_path / "o"),
                 "options.samples=2", "options.seq_len=8"]) == 0
    saved = json.loads((tmp_path / "o" / "layerwise_report.json").read_text())
    assert saved["model"] == "tiny-gpt2" and saved["rows"][-1]["name"] == "final norm"
    assert (tmp_path / "o" / "layerwise_report.png").stat().st_size > 0
    assert "final norm" in capsys.readouterr().out


def test_bert_padding_is_left_out_and_folders_load(tmp_path):
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                     vocab_size=40, max_position_embeddings=16)
    bert = transformers.BertModel(config).eval()
    ids = torch.randint(1, 40, (3, 10))
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0
    rep = layerwise_report(bert, ids, attention_mask=mask, plot=False)
    with torch.no_grad():
        states = bert(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    want = _expected(states, 0.5, 4, keep=mask.bool())
    assert [r["R"] for r in rep.rows] == pytest.approx([w[0] for w in want], rel=1e-9)
    assert rep.rows[0]["R"] != pytest.approx(_expected(states, 0.5, 4)[0][0], rel=1e-6)  # padding would change it
    bert.save_pretrained(tmp_path / "bert")
    again = layerwise_report(str(tmp_path / "bert"), ids, attention_mask=mask, plot=False)
    assert [r["R"] for r in again.rows] == pytest.approx([r["R"] for r in rep.rows], rel=1e-9)


def test_whiteformer_wrappers_and_the_command(tmp_path, capsys):
    from whiteformer.app.cli import main

    net = whiteformer.create_model("tost_t12_p16", img_size=32, patch_size=8, depth=2, num_classes=3).eval()
    config = transformers.AutoConfig.for_model("whiteformer-vision", model_name="tost_t12_p16",
                                               init_kwargs=net.init_kwargs)
    wrapper = transformers.AutoModelForImageClassification.from_config(config).eval()
    wrapper.load_state_dict(net.state_dict())
    x = torch.randn(2, 3, 32, 32)
    own, wrapped = layerwise_report(net, x, plot=False), layerwise_report(wrapper, x, plot=False)
    assert own.rows == wrapped.rows and own.rows[0]["R_c"] is not None  # measured as whiteformer (memberships)
    assert own.rows[0]["delta_R_U"] == pytest.approx(own.rows[0]["R"] - own.rows[0]["R_c_U"])

    _vit().save_pretrained(tmp_path / "vit")
    assert main(["analyze", "layerwise", "--checkpoint", str(tmp_path / "vit"), "--out", str(tmp_path / "out"),
                 "options.samples=2", "--plots", "false"]) == 0
    rows = json.loads((tmp_path / "out" / "layerwise_report.json").read_text())["rows"]
    assert len(rows) == 2 and all(r["attn"] == "vit" and r["R"] > 0 for r in rows)
    assert "random inputs" in capsys.readouterr().out
    assert main(["analyze", "layerwise", "--checkpoint", str(tmp_path / "vit"), "--out", str(tmp_path / "o2"),
                 "options.nope=1"]) == 2
