"""The transformers wrappers exported as users export a causal LM: ``torch.export`` and
``torch.onnx.export(..., dynamo=True)`` of ``AutoModelForCausalLM.from_config(...)`` with default
settings (fused kernels built and enabled), dynamic batch and length, the logits compared with
eager PyTorch (onnxruntime for ONNX) within 1e-4."""
import os

import pytest
import torch
from torch.export import Dim

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("transformers", reason="needs the hf extra: pip install whiteformer[hf]")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import whiteformer  # noqa: E402,F401  (registers the Auto classes)

pytestmark = [pytest.mark.usefixtures("fused_kernel_built"), pytest.mark.slow]

TINY = dict(vocab_size=61, dim=32, depth=2, num_heads=4, max_len=32)
MODELS = [("whiteformer-tost-lm", "tost_lm_base"), ("whiteformer-gpt", "gpt_base")]
TOL = 1e-4


class Logits(torch.nn.Module):
    """``model(input_ids, use_cache=False).logits``: the graph a deployment runs."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def _lm(model_type, name):
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, model_name=name, init_kwargs=TINY)
    return AutoModelForCausalLM.from_config(config).eval()


def _dims():
    return {0: Dim("B", max=64), 1: Dim("T", max=TINY["max_len"])}


def _tests():
    """Inputs of other batch sizes and lengths than the traced one, the full context included."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, TINY["vocab_size"], shape, generator=g) for shape in ((1, 3), (3, TINY["max_len"]))]


def _eager(model, x):
    with torch.no_grad():
        return model(input_ids=x, use_cache=False).logits


@pytest.mark.parametrize("model_type,name", MODELS)
def test_hf_causal_lm_torch_export(model_type, name):
    """The model itself, its output a CausalLMOutputWithPast."""
    model = _lm(model_type, name)
    program = torch.export.export(model, (torch.randint(0, TINY["vocab_size"], (2, 9)),), {"use_cache": False},
                                  dynamic_shapes={"input_ids": _dims(), "use_cache": None})
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not [t for t in targets if "whiteformer" in t], targets
    for x in _tests():
        with torch.no_grad():
            got = program.module()(x, use_cache=False).logits
        assert float((got - _eager(model, x)).abs().max()) <= TOL


@pytest.mark.parametrize("model_type,name", MODELS)
def test_hf_causal_lm_onnx_dynamo(tmp_path, model_type, name):
    """Through a wrapper that returns the logits, so that the ONNX graph has one named output."""
    model = Logits(_lm(model_type, name)).eval()
    path = tmp_path / f"{name}.onnx"
    torch.onnx.export(model, (torch.randint(0, TINY["vocab_size"], (2, 9)),), path, dynamo=True,
                      input_names=["input_ids"], output_names=["logits"], dynamic_shapes=(_dims(),))
    graph = onnx.load(path).graph
    assert all(node.domain in ("", "ai.onnx") for node in graph.node), {n.domain for n in graph.node}
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for x in _tests():
        (got,) = sess.run(None, {"input_ids": x.numpy()})
        assert float((torch.from_numpy(got) - _eager(model.model, x)).abs().max()) <= TOL
