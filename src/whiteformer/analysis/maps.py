"""Pictures of what the heads do on images: membership maps and class-token attention maps.

* :func:`membership_maps`: each head's memberships Pi (one column pi_k of the N x K matrix)
  reshaped to the patch grid, next to the input image (ToST Fig. 4b / 9, DMSA Fig. 6, ECA Fig. 6),
  for one block or, with ``blocks=``, several side by side (the run report draws the first and
  the last).
* :func:`cls_attention_maps`: the class token's softmax attention over the patch tokens in a
  class-attention block, per head (ToST Fig. 5 / 10). The fused layer does not expose the
  weights, so they are recomputed from the layer's ``qkv`` on its captured input
  (:func:`class_attention_weights`).

Both write one PNG grid (a row per image: the image, then one heat map per head, numbered from 1
as in the run report, a title naming the block, and a colour bar) and return the maps
(B, H, Hp, Wp) they drew. The PNG is ``rows * cell_size * dpi`` pixels high and
``(1 + H) * cell_size * dpi`` wide. Needs matplotlib (``viz`` extra).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from .._checks import check_int, check_nonempty, check_positive_real, check_tensor, check_tokens_input, is_int
from .._files import check_path, save_figure
from ._viz import new_figure, require_matplotlib
from .capture import _default_attn_types, capture, eval_mode, supports_pi

__all__ = ["membership_maps", "cls_attention_maps", "class_attention_weights", "patch_grid", "grid_figure",
           "has_class_attention", "has_memberships"]


def has_class_attention(model: nn.Module) -> bool:
    """Whether ``model`` holds a class-attention layer (what :func:`cls_attention_maps` draws)."""
    from ..attention import ClassAttention

    return any(isinstance(m, ClassAttention) for m in model.modules())


def has_memberships(model: nn.Module) -> bool:
    """Whether an attention layer of ``model`` computes memberships Pi (what :func:`membership_maps` draws)."""
    tracked, _ = _default_attn_types()
    return any(isinstance(m, tracked) and supports_pi(m) for m in model.modules())


def patch_grid(model: nn.Module, image_hw: Tuple[int, int], num_tokens: int) -> Tuple[int, int, int]:
    """(prefix, Hp, Wp): how ``num_tokens`` tokens of an image of size ``image_hw`` split into
    ``prefix`` leading non-patch tokens (class token) and a row-major Hp x Wp patch grid.

    Uses ``model.patch_embed.patch_size`` when present, else the factorisation Hp * Wp of the
    token count (minus ``model.num_prefix_tokens``, if any) closest to the image's aspect ratio."""
    H, W = image_hw
    prefixes = sorted({0, int(getattr(model, "num_prefix_tokens", 0) or 0)})
    pe = getattr(model, "patch_embed", None)
    ps = getattr(pe, "patch_size", None)
    if ps is not None:
        ph, pw = (ps, ps) if isinstance(ps, int) else tuple(ps)
        hp, wp = math.ceil(H / ph), math.ceil(W / pw)
        for pre in prefixes:
            if hp * wp + pre == num_tokens:
                return pre, hp, wp
    best = None
    for pre in prefixes:
        n = num_tokens - pre
        for hp in range(1, n + 1):
            if n % hp:
                continue
            wp = n // hp
            err = abs(math.log((hp / wp) / (H / W)))
            if best is None or err < best[0] - 1e-12:
                best = (err, pre, hp, wp)
    if best is None:
        raise ValueError(f"cannot arrange {num_tokens} tokens on a patch grid for images of size {H}x{W}")
    return best[1], best[2], best[3]


def class_attention_weights(attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Attention of the class token (index 0) over all tokens, per head, (B, H, N).

    ``softmax(q_0 k_j^T * scale)`` with ``q_0``, ``k_j`` from the rows of the layer's ``qkv``
    (q: rows 0..C-1, k: C..2C-1, (3, H, p) layout) and ``scale = p^-1/2`` (CaiT/XCiT class
    attention), computed in float32 (float64 for float64 inputs). ``x`` (B, N, C) is the layer's
    input (the normalised tokens, class token first), e.g. ``rec.class_attention[i].input``."""
    C, H = attn.dim, attn.num_heads
    check_tokens_input(x, "x", C)
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = attn.qkv.weight.to(cd)
    b = None if attn.qkv.bias is None else attn.qkv.bias.to(cd)
    xc = x.to(cd)
    q = torch.nn.functional.linear(xc[:, :1], w[:C], None if b is None else b[:C])  # (B, 1, C)
    k = torch.nn.functional.linear(xc, w[C:2 * C], None if b is None else b[C:2 * C])  # (B, N, C)
    q = q.reshape(x.shape[0], 1, H, -1).transpose(1, 2)  # (B, H, 1, p)
    k = k.reshape(x.shape[0], x.shape[1], H, -1).transpose(1, 2)  # (B, H, N, p)
    logits = (q @ k.transpose(-1, -2)).squeeze(-2) * attn.scale  # (B, H, N)
    return logits.softmax(-1)


def _image_for_display(img: torch.Tensor):
    """(C, H, W) -> array (H, W) or (H, W, 3) in [0, 1] (per-image min-max)."""
    img = img.detach().float().cpu()
    img = img[:1] if img.shape[0] < 3 else img[:3]
    lo, hi = img.min(), img.max()
    img = (img - lo) / (hi - lo) if hi > lo else torch.zeros_like(img)
    return img[0].numpy() if img.shape[0] == 1 else img.permute(1, 2, 0).numpy()


#: the grid's layout (figure fractions and font sizes, points)
_LEFT, _RIGHT, _WSPACE = 0.01, 0.86, 0.05
_TITLE_PT, _SUPTITLE_PT = 7, 8


def _grid_layout(rows: int, heads: int, width: float, height: float, titled_rows: bool) -> dict:
    """Subplot fractions of a ``width`` x ``height`` inch grid that leave room, in inches, for each row's
    title above its image (``titled_rows``; else only the first row's column titles) and for the
    figure's title above them. ``height`` grows only when the titles would leave an image less than
    half a cell."""
    import matplotlib

    title_in = (_TITLE_PT * 1.3 + float(matplotlib.rcParams["axes.titlepad"])) / 72
    cell = width * (_RIGHT - _LEFT) / ((1 + heads) + heads * _WSPACE)  # the widest square image
    gap = (title_in + 0.04) if titled_rows else 0.05 * cell
    margin, bottom_in = 0.04, 0.04
    top_in = margin + _SUPTITLE_PT * 1.3 / 72 + 0.06 + title_in
    fixed = top_in + (rows - 1) * gap + bottom_in
    height = max(height, fixed + 0.5 * height)
    row_h = (height - fixed) / rows  # each row's axes height
    return {"height": height, "top": 1 - top_in / height, "bottom": bottom_in / height,
            "hspace": gap / row_h, "suptitle_y": 1 - margin / height}


def grid_figure(images: torch.Tensor, maps: torch.Tensor, title: str, colorbar_label: str, scale_per_map: bool,
                cell_size: float, dpi: int, cmap: str, *, column_titles: Optional[Sequence[str]] = None,
                row_titles: Optional[Sequence[str]] = None):
    """The figure of :func:`membership_maps` / :func:`cls_attention_maps` (not saved): row i = image i,
    then ``maps[i, h]`` under the column title ``head h+1`` (or ``column_titles[h]``); the image
    titled "image" (or ``row_titles[i]``); ``title`` above; one colour bar (labelled
    ``colorbar_label``) for the fixed [0, 1] scale, or "per-map min..max" when ``scale_per_map``."""
    rows, heads = maps.shape[0], maps.shape[1]
    width = (1 + heads) * cell_size
    layout = _grid_layout(rows, heads, width, rows * cell_size, titled_rows=row_titles is not None)
    fig = new_figure((width, layout["height"]), dpi, title)
    axes = fig.subplots(rows, 1 + heads, squeeze=False)
    im = None
    for i in range(rows):
        img = _image_for_display(images[i])
        axes[i][0].imshow(img, cmap="gray" if img.ndim == 2 else None)
        for h in range(heads):
            m = maps[i, h].numpy()
            lo, hi = (float(m.min()), float(m.max())) if scale_per_map else (0.0, 1.0)
            im = axes[i][1 + h].imshow(m, cmap=cmap, vmin=lo, vmax=hi if hi > lo else lo + 1.0,
                                       interpolation="nearest")
        if row_titles is not None:
            axes[i][0].set_title(row_titles[i], fontsize=_TITLE_PT)
        elif i == 0:
            axes[i][0].set_title("image", fontsize=_TITLE_PT)
        if i == 0:
            for h in range(heads):
                axes[i][1 + h].set_title(column_titles[h] if column_titles is not None else f"head {h + 1}",
                                         fontsize=_TITLE_PT)
    for ax in fig.axes:
        ax.set_axis_off()
    top, bottom = layout["top"], layout["bottom"]
    fig.subplots_adjust(left=_LEFT, right=_RIGHT, bottom=bottom, top=top, wspace=_WSPACE, hspace=layout["hspace"])
    fig.suptitle(title, fontsize=_SUPTITLE_PT, y=layout["suptitle_y"], va="top")
    cax = fig.add_axes([0.875, bottom, 0.02, top - bottom])
    bar = fig.colorbar(im, cax=cax)
    bar.set_label(colorbar_label + (" (per map)" if scale_per_map else ""), fontsize=6)
    bar.ax.tick_params(labelsize=5)
    if scale_per_map:
        lo, hi = im.get_clim()
        bar.set_ticks([lo, hi], labels=["min", "max"])
    return fig


def _save(fig, out_path) -> Path:
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, out, dpi=fig.dpi, format="png")
    return out


def _count(max_images, available: int) -> int:
    return available if max_images is None else min(available, max_images)


def _select(seq, index: int, what: str):
    if not is_int(index) or not -len(seq) <= index < len(seq):
        raise ValueError(f"{what} must be an int in [-{len(seq)}, {len(seq)}), got {index!r}")
    return seq[index]


def _run_recorded(model: nn.Module, images, what: str, max_images, cell_size, dpi):
    """Check the arguments of the drawing function ``what``, run ``model`` on ``images`` (no grad,
    eval mode) and return what :func:`capture` recorded."""
    require_matplotlib(what)
    check_tensor(images, "images", 4)
    check_nonempty(images, "images", 0, "images")
    check_positive_real(cell_size, "cell_size")
    check_positive_real(dpi, "dpi")
    if max_images is not None:
        check_int(max_images, "max_images", 1)
    with torch.no_grad(), eval_mode(model), capture(model) as rec:
        model(images)
    return rec


def membership_maps(
    model: nn.Module,
    images: torch.Tensor,
    out_path: Union[str, Path],
    layer: int = -1,
    *,
    blocks: Optional[Sequence[int]] = None,
    labels: Optional[torch.Tensor] = None,
    preds: Optional[torch.Tensor] = None,
    max_images: Optional[int] = 8,
    cell_size: float = 1.5,
    dpi: int = 100,
    cmap: str = "viridis",
) -> torch.Tensor:
    """Draw each head's memberships over the patch grid next to each image (PNG grid).

    Args:
        model: a vision model whose blocks compute memberships (TSSA, DMSA, ECA attention).
        images: (B, C, H, W) input batch (model-ready, e.g. normalised).
        out_path: PNG file to write (parent directories are created).
        layer: index of the block (among the recorded blocks, negative from the end).
        blocks: several block indices instead of ``layer`` (duplicates drawn once, in the order
            of the blocks): every head of each, side by side, columns titled "block b head h" (from 1).
        labels, preds: (B,) class labels and predictions, written above each image ("y=.. pred=..").
        max_images: draw at most this many images (None: all).
        cell_size, dpi: each cell is ``cell_size`` inches at ``dpi`` (the titles take their room from it); colour
            scale [0, 1].
    Returns:
        the drawn maps (float32, CPU): (B', H, Hp, Wp), ``maps[i, k]`` = pi_k of image i; with
        ``blocks``, (B', len(blocks), H, Hp, Wp), ``maps[i, j, k]`` = pi_k of image i in block j.
    """
    check_path(out_path, "out_path")
    rec = _run_recorded(model, images, "membership_maps", max_images, cell_size, dpi)
    if not rec.blocks:
        raise ValueError(f"model ({type(model).__name__}) has no attention blocks")
    if blocks is None:
        wanted = [_select(rec.blocks, layer, "layer").index]
    else:
        if isinstance(blocks, (str, bytes)) or not hasattr(blocks, "__iter__") or not list(blocks):
            raise ValueError(f"blocks must be a non-empty sequence of block indices, got {blocks!r}")
        wanted = []
        for b in blocks:
            i = _select(rec.blocks, b, "each of blocks").index
            if i not in wanted:
                wanted.append(i)
    pis = []
    for i in wanted:
        r = rec.blocks[i]
        if r.pi is None:
            raise ValueError(f"block {r.name!r} ({type(r.attn).__name__}) has no memberships Pi; membership maps "
                             "need TSSA, DMSA or ECA attention")
        pis.append(r.pi.float().cpu())  # (B, H, N)
    pre, hp, wp = patch_grid(model, tuple(images.shape[-2:]), pis[0].shape[-1])
    n = _count(max_images, pis[0].shape[0])
    maps = torch.stack([pi[:n, :, pre:].reshape(n, pi.shape[1], hp, wp) for pi in pis], 1)  # (B', J, H, Hp, Wp)
    heads = maps.shape[2]
    rows = None
    if labels is not None and preds is not None:
        rows = [f"y={int(labels[i])} pred={int(preds[i])}" for i in range(n)]
    if blocks is None:
        title = f"memberships pi, block {wanted[0] + 1} of {len(rec.blocks)}"
        cols = None
    else:
        title = (f"memberships pi of each token to each head (subspace), blocks "
                 f"{', '.join(str(i + 1) for i in wanted)} of {len(rec.blocks)}")
        cols = [f"block {i + 1} head {h + 1}" for i in wanted for h in range(heads)]
    fig = grid_figure(images[:n], maps.flatten(1, 2), title, "membership pi", False, cell_size, dpi, cmap,
                      column_titles=cols, row_titles=rows)
    _save(fig, out_path)
    return maps[:, 0] if blocks is None else maps


def cls_attention_maps(
    model: nn.Module,
    images: torch.Tensor,
    out_path: Union[str, Path],
    block: int = -1,
    *,
    max_images: Optional[int] = 8,
    cell_size: float = 1.5,
    dpi: int = 100,
    cmap: str = "inferno",
) -> torch.Tensor:
    """Draw the class token's attention over the patches, per head, in a class-attention block.

    Args:
        model: a model with class-attention layers (the ToST/XCiT shell's ``cls_attn_blocks``).
        images: (B, C, H, W).
        out_path: PNG file to write.
        block: which class-attention block (default the last; ToST has two).
        max_images, cell_size, dpi: as :func:`membership_maps`; each map's colours span its
            own [min, max].
    Returns:
        the drawn maps (B', H, Hp, Wp): softmax weights of the class token's query on the patch
        tokens (the weight on the class token itself is left out, so a map sums to <= 1).
    """
    check_path(out_path, "out_path")
    rec = _run_recorded(model, images, "cls_attention_maps", max_images, cell_size, dpi)
    if not rec.class_attention:
        raise ValueError(f"model ({type(model).__name__}) has no class-attention layers (ClassAttention)")
    r = _select(rec.class_attention, block, "block")
    with torch.no_grad():
        weights = class_attention_weights(r.attn, r.input).float().cpu()  # (B, H, 1 + N)
    pre, hp, wp = patch_grid(model, tuple(images.shape[-2:]), weights.shape[-1] - 1)
    n = _count(max_images, weights.shape[0])
    maps = weights[:n, :, 1 + pre:].reshape(n, weights.shape[1], hp, wp)
    idx = block % len(rec.class_attention)
    title = f"[CLS] attention over the patches, class-attention block {idx + 1} of {len(rec.class_attention)}"
    _save(grid_figure(images[:n], maps, title, "[CLS] attention weight", True, cell_size, dpi, cmap), out_path)
    return maps
