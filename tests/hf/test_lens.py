"""The white-box lens on any transformers model: layerwise_report / `whiteformer analyze layerwise`
on GPT-2, ViT and BERT built from configs, checked against an independent recomputation of the rates
from the hidden states."""
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


@pytest.mark.parametrize("make,inputs", [(_gpt2, lambda: torch.randint(0, 50, (3, 10))),
                                         (_vit, lambda: torch.randn(2, 3, 32, 32))], ids=["gpt2", "vit"])
def test_layerwise_report_on_a_transformers_model(tmp_path, make, inputs):
    model, x = make(), inputs()
    rep = layerwise_report(model, x, eps=0.5, out_dir=tmp_path)
    with torch.no_grad():
        states = model(**{model.main_input_name: x, "output_hidden_states": True}).hidden_states
    want = _expected(states, 0.5, model.config.num_attention_heads)
    assert len(rep.rows) == len(states) - 1 == model.config.num_hidden_layers
    for row, (R, Rc) in zip(rep.rows, want):
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
