"""Export with default settings (fused kernels built and enabled): torch.export (a saved .pt2 runs
in a process that never imports whiteformer) and ONNX (the dynamo exporter for every family, the
TorchScript one for the vision models), compared with PyTorch through onnxruntime."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.export import Dim

from tiny_models import FAMILIES, tiny
from whiteformer.compress import compress
from whiteformer.models import create_model
from whiteformer.models.lm_step import LMStep
from whiteformer.ops._kernels import exporting, fused_supported

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

pytestmark = [pytest.mark.usefixtures("fused_kernel_built"), pytest.mark.slow]

VISION = ["tost_t12_p16", "dmst_t12_p16", "eca_t", "xcit_s12_p16", "vit_cab_s12_p16", "crate_t", "deit_t_p16"]
LMS = ("tost_lm_base", "gpt_base")
TOL = 1e-4  # fp32, onnxruntime / a loaded .pt2 against eager PyTorch

# loads each .pt2 in a fresh interpreter in which importing whiteformer fails, runs it on the saved
# inputs and saves the outputs
_LOADER = textwrap.dedent("""
    import importlib.abc, json, sys
    class _NoWhiteformer(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "whiteformer":
                raise ImportError("whiteformer must not be imported here")
    sys.meta_path.insert(0, _NoWhiteformer())
    import torch
    for name in json.loads(sys.argv[1]):
        program = torch.export.load(name + ".pt2")
        inputs = torch.load(name + ".in.pt")
        with torch.no_grad():
            out = program.module()(*inputs)
        torch.save(out, name + ".out.pt")
    assert not any(m.split(".")[0] == "whiteformer" for m in sys.modules)
""")


def _ort_run(path, inputs):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {i.name: t.numpy() for i, t in zip(sess.get_inputs(), inputs)}
    return [torch.from_numpy(o) for o in sess.run(None, feeds)]


def _max_diff(got, want):
    return max(float((g - w).abs().max()) for g, w in zip(got, want))


def _vision(name):
    model, (images,), _ = tiny(name)
    return model.eval(), images


def _check_graph(program):
    """Only standard operators in the graph: no whiteformer custom op (fused kernels) left."""
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not [t for t in targets if "whiteformer" in t], targets


@pytest.fixture(scope="module")
def programs():
    """torch.export with default settings of one tiny model of every family and of a compressed ViT,
    with a dynamic batch (and, for the language models, a dynamic length up to max_len):
    {name: (model, program, test inputs)}, the test inputs of a batch (and length) other than the
    traced ones."""
    out = {}
    for name in FAMILIES:
        model, inputs, _ = tiny(name)
        model.eval()
        x = inputs[0]
        dims = {0: Dim("B", max=64)}
        if name in LMS:
            dims[1] = Dim("T", max=model.max_len)  # the whole context, position table included
            test = torch.randint(0, model.vocab_size, (3, model.max_len))
        elif x.dtype == torch.long:  # LRA tokens
            test = torch.randint(1, int(x.max()) + 1, (3, x.shape[1]))
        else:
            test = torch.randn(3, *x.shape[1:])
        out[name] = (model, torch.export.export(model, (x,), dynamic_shapes=(dims,)), (test,))
    vit = _compressed_vit()
    program = torch.export.export(vit, (torch.randn(2, 3, 32, 32),), dynamic_shapes=({0: Dim("B", max=64)},))
    out["compressed_vit"] = (vit, program, (torch.randn(3, 3, 32, 32),))
    for _, program, _ in out.values():
        _check_graph(program)
    return out


def _eager(model, inputs):
    with torch.no_grad():
        out = model(*inputs)
    return [out[0] if isinstance(out, tuple) else out]  # the LM: (logits, loss=None)


@pytest.fixture(scope="module")
def loaded_outputs(programs, tmp_path_factory):
    """Each program saved as .pt2, loaded and run in one subprocess that cannot import whiteformer:
    {name: its outputs}."""
    root = tmp_path_factory.mktemp("pt2")
    for name, (_, program, inputs) in programs.items():
        torch.export.save(program, root / f"{name}.pt2")
        torch.save(inputs, root / f"{name}.in.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-c", _LOADER, json.dumps(list(programs))], cwd=root, env=env, check=True,
                   timeout=600)
    out = {}
    for name in programs:
        got = torch.load(root / f"{name}.out.pt")
        out[name] = [got[0] if isinstance(got, tuple) else got]
    return out


def _compressed_vit():
    model = create_model("deit_t_p16", img_size=32, patch_size=8, num_classes=5, depth=2, embed_dim=48,
                         num_heads=3).eval()
    calib = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    new, _ = compress(model, qk="irratt", qk_flops_ratio=0.5, vo_rank=8, calib=calib, latency_runs=0)
    return new.eval()


def test_kernels_enabled_outside_export():
    """The fused kernel runs in eager mode (when it builds here): export is what switches it off."""
    from whiteformer.ops._kernels.build import fast_path_available

    assert not exporting()
    if fast_path_available():
        assert fused_supported(torch.randn(1, 2, 4, 8))


@pytest.mark.parametrize("name", [*FAMILIES, "compressed_vit"])
def test_saved_pt2_runs_without_whiteformer(programs, loaded_outputs, name):
    model, _, inputs = programs[name]
    assert _max_diff(loaded_outputs[name], _eager(model, inputs)) <= TOL


def _onnx_check(path, model, inputs):
    graph = onnx.load(path).graph
    assert all(node.domain in ("", "ai.onnx") for node in graph.node), {n.domain for n in graph.node}
    assert _max_diff(_ort_run(path, list(inputs)), _eager(model, inputs)) <= TOL


@pytest.mark.parametrize("name", [*FAMILIES, "compressed_vit"])
def test_onnx_dynamo(programs, tmp_path, name):
    """The dynamo exporter (torch.onnx.export(..., dynamo=True) runs torch.export, then translates the
    program: here the program of the fixture, exported with default settings)."""
    model, program, inputs = programs[name]
    path = tmp_path / f"{name}.onnx"
    torch.onnx.export(program, dynamo=True, f=path, output_names=["logits"])
    _onnx_check(path, model, inputs)


@pytest.mark.parametrize("name", VISION)
def test_onnx_torchscript_exporter(tmp_path, name):
    model, images = _vision(name)
    path = tmp_path / f"{name}.onnx"
    torch.onnx.export(model, (images,), path, dynamo=False, input_names=["images"], output_names=["logits"],
                      dynamic_axes={"images": {0: "B"}, "logits": {0: "B"}})
    _onnx_check(path, model, (torch.randn(3, *images.shape[1:]),))  # a batch other than the traced one


def test_onnx_lm_forward_dynamic_batch_and_length(tmp_path):
    lm, (idx, _), _ = tiny("tost_lm_base")
    lm.eval()
    path = tmp_path / "lm.onnx"
    torch.onnx.export(lm, (idx,), path, dynamo=True, input_names=["idx"], output_names=["logits"],
                      dynamic_shapes=({0: Dim("B", max=64), 1: Dim("T", max=lm.max_len)},))
    for shape in ((1, 5), (3, lm.max_len)):
        x = torch.randint(0, lm.vocab_size, shape)
        with torch.no_grad():
            want = lm(x)[0]
        assert _max_diff(_ort_run(path, [x]), [want]) <= TOL


def test_onnx_lm_step_with_explicit_state(tmp_path):
    """One generation step, its constant-size state as inputs and outputs: onnxruntime continues a
    prompt's state (from prefill) exactly as LM.step does."""
    lm, (idx, _), _ = tiny("tost_lm_base")
    lm.eval()
    step = LMStep(lm).eval()
    path = tmp_path / "step.onnx"
    torch.onnx.export(step, step.example_inputs(batch_size=2), path, dynamo=True, input_names=step.input_names(),
                      output_names=step.output_names(), dynamic_shapes=step.dynamic_shapes(max_batch=64))
    prompt = torch.randint(0, lm.vocab_size, (3, 5))
    nxt = torch.randint(0, lm.vocab_size, (3,))
    with torch.no_grad():
        _, state = lm.prefill(prompt)
        logits, new = lm.step(nxt, state)
    flat = LMStep.state_tensors(state)
    got = _ort_run(path, [nxt, torch.full((3,), 5, dtype=torch.long), *flat])
    want = [logits, torch.full((3,), 6), *LMStep.state_tensors(new)]
    assert got[1].tolist() == [6, 6, 6]
    assert _max_diff(got, want) <= TOL


def test_lm_step_carries_the_state_scale():
    """Projections large enough that the state is rescaled (|w| > 2^32, squares beyond float32):
    LMStep's explicit state holds each block's scale, so it continues a prefill as LM.step does."""
    lm, _, _ = tiny("tost_lm_base")
    lm.eval()
    with torch.no_grad():
        for blk in lm.transformer.h:
            blk.attn.qkv.weight.mul_(1e25)
    step = LMStep(lm).eval()
    prompt = torch.randint(0, lm.vocab_size, (2, 4))
    nxt = torch.randint(0, lm.vocab_size, (2,))
    with torch.no_grad():
        _, state = lm.prefill(prompt)
        logits, new = lm.step(nxt, state)
        flat = LMStep.state_tensors(state)
        got, pos, *got_state = step(nxt, torch.full((2,), 4), *flat)
    assert all((layer.scale > 1).all() for layer in state.layers)
    assert torch.isfinite(logits).all() and torch.isfinite(got).all()
    torch.testing.assert_close(got, logits)
    want = LMStep.state_tensors(new)
    for a, b in zip(got_state, want, strict=True):
        torch.testing.assert_close(a, b)


def test_lm_step_refuses_gpt():
    gpt, _, _ = tiny("gpt_base")
    with pytest.raises(TypeError, match="key/value cache"):
        LMStep(gpt)
    with pytest.raises(TypeError, match="model must be a CausalLM"):
        LMStep(gpt.transformer)


def test_lm_step_refuses_a_wrong_state():
    lm, _, _ = tiny("tost_lm_base")
    step = LMStep(lm).eval()
    idx, pos, *state = step.example_inputs(2)
    with pytest.raises(ValueError, match=rf"expected {len(state)} state tensors .* got {len(state) - 1}"):
        step(idx, pos, *state[:-1])
    with pytest.raises(ValueError, match=r"pos must be a \(B,\) integer tensor, got int"):
        step(idx, 0, *state)


def _eca_eps0():
    torch.manual_seed(0)
    kw = dict(FAMILIES["eca_t"], attn_kwargs={"rank": 2, "eps": 0.0})
    return create_model("eca_t", **kw).eval(), torch.randn(2, 3, kw["img_size"], kw["img_size"])


@pytest.mark.parametrize("dynamo", [True, False])
def test_onnx_eca_eps0_says_why_it_cannot_export(tmp_path, dynamo):
    """ECA with eps=0 needs a Cholesky factorisation with a QR fallback: ONNX has neither, so both
    exporters stop with an error that names eps, not with an unsupported-operator message."""
    model, images = _eca_eps0()
    with pytest.raises(Exception, match=r"eps=0 cannot be exported to ONNX") as info:
        torch.onnx.export(model, (images,), tmp_path / "eca.onnx", dynamo=dynamo)
    chain, err = [], info.value
    while err is not None:
        chain.append(err)
        err = err.__cause__ or err.__context__
    assert any(isinstance(e, ValueError) for e in chain)


@pytest.mark.parametrize("strict", [False, True])
def test_torch_export_eca_eps0_keeps_the_cholesky_basis(strict):
    """torch.export has the Cholesky and QR operators: eps=0 exports there (also through Dynamo,
    where the ONNX check must not fire) and matches eager."""
    model, images = _eca_eps0()
    program = torch.export.export(model, (images,), dynamic_shapes=({0: Dim("B", max=64)},), strict=strict)
    _check_graph(program)
    x = torch.randn(3, *images.shape[1:])
    with torch.no_grad():
        assert _max_diff([program.module()(x)], [model(x)]) <= TOL
