"""Record what every transformer block sees and produces, without changing the model.

::

    from whiteformer.analysis.capture import capture

    with capture(model) as rec:
        logits = model(images)          # bitwise the same output as without ``capture``
    for b in rec.blocks:                # one record per block, in module order
        b.name, b.input, b.output       # block input / output tokens (B, N, C)
        b.attn_input, b.attn_output     # the attention layer's input (normed tokens) / output
        b.pi, b.gate                    # memberships (B, H, N) and DMSA head gates (B, H), or None
        b.attn                          # the attention module (U = its projection, see ``basis``)

What is tracked (on any ``nn.Module``: the vision shell, the language models, CRATE, DeiT):

* attention layers: every class of the :mod:`whiteformer.attention` registry except the class
  attention (TSSA, CausalTSSA, DMSA, ECAttention, MHSA, XCA, MSSA, the GPT baseline's
  CausalSelfAttention and the compressed layers), or the classes given as ``attn_types``. A
  tracked layer nested in another tracked layer is not tracked separately.
* the block of an attention layer: its parent module, unless the parent is a container
  (``ModuleList`` / ``Sequential`` / ``ModuleDict``) or holds other tracked layers; then the
  attention layer itself is the block.
* class-attention layers (``ClassAttention`` of the ToST/XCiT head): their input and output in
  ``rec.class_attention`` (used by :func:`whiteformer.analysis.maps.cls_attention_maps`).

How: forward hooks on the blocks and the class-attention layers; on the attention layers that
can return memberships (``forward(..., return_pi=True)``: TSSA, CausalTSSA, DMSA, ECA with its
compression module) the instance's ``forward`` is replaced for the duration of the ``with`` by
a wrapper that calls the original with ``return_pi=True`` and returns only ``y``. Those layers
compute the same ``y`` in both cases, so the model output is unchanged bit for bit. On exit
(also on an exception inside the ``with``) the hooks are removed and the original ``forward``
attributes restored. Only calls to ``forward`` are seen (``prefill`` / ``step`` of the language
models are not). When a block runs several times, its record holds the last call (``calls``
counts them). Stored tensors are detached (and cloned when ``clone=True``, the default).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Type

import torch
import torch.nn as nn

from .._checks import check_instance
from .._utils import eval_mode  # noqa: F401  (re-exported: whiteformer.analysis.capture.eval_mode)

__all__ = ["BlockRecord", "ClassAttentionRecord", "Recording", "capture", "attention_basis", "supports_pi", "eval_mode"]

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


# ----------------------------------------------------------------------------- records
@dataclasses.dataclass
class BlockRecord:
    """What one block saw and produced in the last forward call (tensors detached).

    Attributes:
        index: position among the recorded blocks (module order).
        name: qualified module name of the block (``"blocks.3"``, ``"transformer.h.0"``).
        attn_name: qualified module name of its attention layer.
        block, attn: the modules.
        input, output: block input / output tokens (B, N, C) (the first tensor argument / the
            first element of a tuple output).
        attn_input, attn_output: the attention layer's input (the normalised tokens in pre-norm
            blocks) and output y, (B, N, C).
        pi: memberships (B, H, N) (TSSA, causal TSSA, DMSA, ECA), else None.
        gate: DMSA head gates (B, H), else None.
        calls: number of forward calls of the block seen inside the ``with``.
    """

    index: int
    name: str
    attn_name: str
    block: nn.Module = dataclasses.field(repr=False)
    attn: nn.Module = dataclasses.field(repr=False)
    input: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False)
    output: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False)
    attn_input: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False)
    attn_output: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False)
    pi: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False)
    gate: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False)
    calls: int = 0

    @property
    def memberships(self) -> Optional[torch.Tensor]:
        """``pi`` in the layout of :mod:`whiteformer.analysis.rates`: (B, N, H) (tokens as rows)."""
        return None if self.pi is None else self.pi.transpose(-1, -2)

    @property
    def num_heads(self) -> Optional[int]:
        return getattr(self.attn, "num_heads", None)


@dataclasses.dataclass
class ClassAttentionRecord:
    """Input (B, 1 + N, C) (normalised tokens, class token first) and output of a class-attention
    layer in the last forward call."""

    index: int
    name: str
    attn: nn.Module = dataclasses.field(repr=False)
    input: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False)
    output: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False)
    calls: int = 0


class Recording:
    """The object bound by ``with capture(model) as rec``: ``rec.blocks`` (list of
    :class:`BlockRecord`) and ``rec.class_attention`` (list of :class:`ClassAttentionRecord`)."""

    def __init__(self, blocks: List[BlockRecord], class_attention: List[ClassAttentionRecord]):
        self.blocks = blocks
        self.class_attention = class_attention

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> BlockRecord:
        return self.blocks[i]

    def __iter__(self) -> Iterator[BlockRecord]:
        return iter(self.blocks)

    @property
    def pis(self) -> List[Optional[torch.Tensor]]:
        """Memberships (B, H, N) of every block (None where the layer has none)."""
        return [b.pi for b in self.blocks]

    def clear(self) -> None:
        """Forget the recorded tensors (e.g. between two forward calls)."""
        for r in self.blocks:
            r.input = r.output = r.attn_input = r.attn_output = r.pi = r.gate = None
            r.calls = 0
        for r in self.class_attention:
            r.input = r.output = None
            r.calls = 0

    def __repr__(self) -> str:
        return f"Recording({len(self.blocks)} blocks, {len(self.class_attention)} class-attention layers)"


# ----------------------------------------------------------------------------- discovery
def _default_attn_types() -> Tuple[Tuple[type, ...], Tuple[type, ...]]:
    """(tracked attention classes, class-attention classes), read from the registry at call time
    (so layers registered later, e.g. by :mod:`whiteformer.compress`, are included)."""
    from ..attention import registry
    from ..attention.baselines import ClassAttention

    tracked = [registry.get_attention_class(n) for n in registry.list_attention()]
    tracked = [c for c in tracked if not issubclass(c, ClassAttention)]
    return tuple(tracked), (ClassAttention,)


def supports_pi(attn: nn.Module) -> bool:
    """Whether ``attn`` returns memberships: its class says so (``returns_pi = True``: ``forward``
    takes ``return_pi``), and it computes them (ECA without compression has no Pi)."""
    return getattr(attn, "returns_pi", False) and getattr(attn, "use_compress", True) is not False


def attention_basis(attn: nn.Module) -> Optional[torch.Tensor]:
    """The subspace bases U = [U_1 ... U_K] (d, K*p) of an attention layer, or None.

    * TSSA / causal TSSA / DMSA / CRATE's MSSA: the single projection ``qkv`` (K*p, d);
      U_k = (rows of head k)^T, i.e. ``U = qkv.weight^T`` (ToST Eq. 31 / DMSA's full space S; the
      bias, if any, is ignored). For DMSA this is S, before the head gate (see
      :func:`whiteformer.analysis.report.layer_bases`).
    * ECAttention: its ``U`` parameter (None without the compression module).
    * softmax attention with a (3C, C) ``qkv`` (MHSA, XCA, GPT) and others: None.
    """
    from ..attention import DMSA, MSSA, TSSA, CausalTSSA, ECAttention

    if isinstance(attn, ECAttention):
        return None if attn.U is None else attn.U.detach()
    if isinstance(attn, (TSSA, CausalTSSA, DMSA, MSSA)):
        return attn.qkv.weight.detach().transpose(0, 1)
    return None


def _find(model: nn.Module, tracked: Tuple[type, ...], cls_types: Tuple[type, ...]):
    named = list(model.named_modules())
    attn_names: List[str] = []
    cls_names: List[str] = []
    for name, m in named:
        if isinstance(m, cls_types):
            cls_names.append(name)
        elif isinstance(m, tracked) and not any(_inside(name, a) for a in attn_names):
            attn_names.append(name)
    modules = dict(named)
    pairs = []
    for a in attn_names:
        block_name = a
        if a:  # not the root
            parent = a.rsplit(".", 1)[0] if "." in a else ""
            pmod = modules[parent]
            others = [o for o in attn_names if o != a and _inside(o, parent)]
            if not isinstance(pmod, _CONTAINERS) and not others:
                block_name = parent
        pairs.append((block_name, a))
    return modules, pairs, cls_names


def _inside(name: str, prefix: str) -> bool:
    """Whether module ``name`` is ``prefix`` or below it ("" is the root)."""
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def _first_tensor(args: Sequence[Any], kwargs: Dict[str, Any]) -> Optional[torch.Tensor]:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    for v in kwargs.values():
        if isinstance(v, torch.Tensor):
            return v
    return None


def _main_output(out: Any) -> Optional[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


# ----------------------------------------------------------------------------- context manager
@contextlib.contextmanager
def capture(model: nn.Module, *, attn_types: Optional[Sequence[Type[nn.Module]]] = None,
            clone: bool = True) -> Iterator[Recording]:
    """Record per block its input/output tokens, memberships Pi and gates during forwards.

    Args:
        model: any ``nn.Module`` containing attention layers (see the module docstring).
        attn_types: attention classes to track instead of the registry's.
        clone: store clones of the tensors (safe against later in-place updates); ``False``
            stores detached views.
    Yields:
        a :class:`Recording`; the model is restored exactly on exit, also after an exception.
    Raises:
        TypeError: ``model`` is not an ``nn.Module``; ValueError: it has no attention layer.
    """
    check_instance(model, "model", nn.Module, "a torch.nn.Module")
    if attn_types is None:
        tracked, cls_types = _default_attn_types()
    else:
        tracked = tuple(attn_types)
        if not tracked or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in tracked):
            raise TypeError(f"attn_types must be a non-empty sequence of nn.Module classes, got {attn_types!r}")
        cls_types = _default_attn_types()[1]
    modules, pairs, cls_names = _find(model, tracked, cls_types)
    if not pairs and not cls_names:
        raise ValueError(f"model ({type(model).__name__}) contains no attention layer to record; tracked classes: "
                         f"{sorted(t.__name__ for t in tracked)}")

    def keep(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if t is None:
            return None
        t = t.detach()
        return t.clone() if clone else t

    blocks = [BlockRecord(i, b, a, modules[b], modules[a]) for i, (b, a) in enumerate(pairs)]
    cls_recs = [ClassAttentionRecord(i, n, modules[n]) for i, n in enumerate(cls_names)]
    rec = Recording(blocks, cls_recs)

    handles = []
    patched: List[Tuple[nn.Module, bool, Any]] = []  # (module, had own 'forward', previous value)
    try:
        for r in blocks:
            def block_hook(mod, args, kwargs, out, r=r):
                r.input = keep(_first_tensor(args, kwargs))
                r.output = keep(_main_output(out))
                r.calls += 1

            handles.append(r.block.register_forward_hook(block_hook, with_kwargs=True))
            patched.append((r.attn, "forward" in r.attn.__dict__, r.attn.__dict__.get("forward")))
            r.attn.forward = _wrap_attention(r.attn.forward, r, keep, supports_pi(r.attn))
        for r in cls_recs:
            def cls_hook(mod, args, kwargs, out, r=r):
                r.input = keep(_first_tensor(args, kwargs))
                r.output = keep(_main_output(out))
                r.calls += 1

            handles.append(r.attn.register_forward_hook(cls_hook, with_kwargs=True))
        yield rec
    finally:
        for h in reversed(handles):
            h.remove()
        for mod, had, prev in reversed(patched):
            if had:
                mod.forward = prev
            else:
                mod.__dict__.pop("forward", None)


def _wrap_attention(orig, r: BlockRecord, keep, with_pi: bool):
    """A stand-in for ``attn.forward`` recording input, output and stats; returns what the
    caller asked for (``y``, or ``(y, stats)`` if it passed ``return_pi=True`` itself)."""
    sig = inspect.signature(orig) if with_pi else None

    def forward(*args, **kwargs):
        x = _first_tensor(args, kwargs)
        stats = None
        if with_pi:
            bound = sig.bind(*args, **kwargs)  # return_pi may come by keyword or by position
            asked = bool(bound.arguments.get("return_pi", False))
            bound.arguments["return_pi"] = True
            y, stats = orig(*bound.args, **bound.kwargs)
            out = (y, stats) if asked else y
        else:
            out = y = orig(*args, **kwargs)
        r.attn_input = keep(x)
        r.attn_output = keep(_main_output(y))
        stats = stats if isinstance(stats, dict) else {}
        r.pi = keep(stats.get("pi"))
        r.gate = keep(stats.get("gate"))
        return out

    # keeps ``inspect.signature(attn.forward)`` (followed through __wrapped__) as the original's
    return functools.wraps(orig)(forward)
