"""Pictures of the run report and of whiteformer.analysis.maps: block labels,
1-based head numbers, colour bars, the [CLS] attention maps and the coding-rate reading line.
Contents (titles, labels, report text) are checked, not pixels."""
import pytest
import torch

import whiteformer
from whiteformer.analysis.maps import cls_attention_maps, grid_figure, membership_maps
from whiteformer.analysis.report import RATE_READING, coding_rate_figure

pytest.importorskip("matplotlib")

TINY = dict(img_size=8, patch_size=2, in_chans=1, depth=2, embed_dim=16, num_heads=2, num_classes=10)


def _texts(fig):
    out = [t.get_text() for t in fig.texts]
    if getattr(fig, "_suptitle", None) is not None:
        out.append(fig._suptitle.get_text())
    for ax in fig.axes:
        out += [ax.get_title(), ax.get_ylabel(), ax.get_xlabel()]
    return [t for t in out if t]


def _spy_on_grid_figure(monkeypatch):
    """A list that receives the texts of every figure the maps draw."""
    seen = []

    def spy(*a, **k):
        fig = grid_figure(*a, **k)
        seen.append(_texts(fig))
        return fig

    monkeypatch.setattr("whiteformer.analysis.maps.grid_figure", spy)
    return seen


def test_grid_figure_has_block_title_one_based_heads_and_colorbar():
    maps = torch.rand(2, 3, 4, 4)
    fig = grid_figure(torch.rand(2, 1, 8, 8), maps, "memberships pi, block 2 of 2", "membership pi", False, 1, 40,
                      "viridis")
    texts = _texts(fig)
    assert "memberships pi, block 2 of 2" in texts
    assert {"head 1", "head 2", "head 3"} <= set(texts) and "head 0" not in texts
    assert "membership pi" in texts  # the colour bar's label (on its own axes)
    assert len(fig.axes) == 2 * (1 + 3) + 1


def test_maps_name_the_block(tmp_path, monkeypatch):
    model = whiteformer.create_model("tost_t12_p16", **TINY).eval()
    seen = _spy_on_grid_figure(monkeypatch)
    x = torch.randn(2, 1, 8, 8)
    membership_maps(model, x, tmp_path / "m.png", layer=0)
    cls_attention_maps(model, x, tmp_path / "c.png")
    assert "memberships pi, block 1 of 2" in seen[0]
    assert any(t.startswith("[CLS] attention over the patches, class-attention block 2 of 2") for t in seen[1])
    assert (tmp_path / "m.png").is_file() and (tmp_path / "c.png").is_file()


def test_report_figures_say_what_they_show(tmp_path, monkeypatch):
    fig = coding_rate_figure([3.0, 2.5, 2.0])
    assert any("rising" in t and "falling" in t for t in _texts(fig))
    assert "layer-wise coding rate of the tokens (eps 0.5)" in _texts(fig)
    model = whiteformer.create_model("tost_t12_p16", **TINY).eval()
    seen = _spy_on_grid_figure(monkeypatch)
    maps = membership_maps(model, torch.randn(2, 1, 8, 8), tmp_path / "m.png", blocks=[0, -1],
                           labels=torch.tensor([3, 4]), preds=torch.tensor([3, 5]))
    assert maps.shape == (2, 2, 2, 4, 4)  # (images, blocks, heads, Hp, Wp)
    texts = set(seen[0])
    assert {"block 1 head 1", "block 1 head 2", "block 2 head 1", "block 2 head 2"} <= texts
    assert {"y=3 pred=3", "y=4 pred=5"} <= texts and "membership pi" in texts  # colour bar
    # the same block twice is drawn once; a block index out of range names the argument
    assert membership_maps(model, torch.randn(1, 1, 8, 8), tmp_path / "o.png", blocks=[1, -1]).shape[1] == 1
    with pytest.raises(ValueError, match="each of blocks"):
        membership_maps(model, torch.randn(1, 1, 8, 8), tmp_path / "o.png", blocks=[2])


def test_run_report_includes_cls_attention_maps_and_rate_reading(tmp_path):
    import matplotlib.pyplot as plt

    from whiteformer.app.train.tasks import ReportContext
    from whiteformer.app.train.tasks.classification import ImageClassificationTask

    task = object.__new__(ImageClassificationTask)  # report_sections reads only its context
    x, labels = torch.randn(2, 1, 8, 8), torch.tensor([1, 2])
    model = whiteformer.create_model("tost_t12_p16", **TINY).eval()
    figures, notes = {}, []
    lines = task.report_sections(model, ReportContext(tmp_path, plt, x, labels, {}, figures, notes, 2))
    text = "\n".join(lines)
    assert not notes, notes
    assert "## [CLS] attention maps" in text and "![cls attention](cls_attention.png)" in text
    assert "numbered from 1" in text and figures["cls_attention"] == "cls_attention.png"
    assert (tmp_path / "cls_attention.png").is_file() and (tmp_path / "membership.png").is_file()
    # a model without class attention: no [CLS] section
    deit = whiteformer.create_model("deit_t_p16", **TINY).eval()
    lines = task.report_sections(deit, ReportContext(tmp_path, plt, x, labels, {}, {}, [], 2))
    assert "## [CLS] attention maps" not in "\n".join(lines)
    assert "Reading: rising" not in "\n".join(lines) and "rising" in RATE_READING


def _lens_report(final_R: float, final_Rc: float):
    from whiteformer.analysis.report import COLUMNS, LayerwiseReport

    def row(layer, name, R, Rc):
        r = dict.fromkeys(COLUMNS)
        r.update(layer=layer, name=name, R=R, R_c_U=Rc, delta_R_U=R - Rc)
        return r

    torch.manual_seed(0)
    rows = [row(i + 1, f"layer {i + 1}", 10 + float(torch.rand(())), 4 + float(torch.rand(()))) for i in range(5)]
    return LayerwiseReport(rows + [row(None, "final norm", final_R, final_Rc)], eps=0.5, features="output",
                           num_samples=8, model="gpt2")


@pytest.mark.parametrize("final", [(800.0, 300.0), (-500.0, -900.0), (1e6, 2.0)])
def test_lens_figure_keeps_the_layers_scale_when_the_final_norm_is_far_off(final):
    rep = _lens_report(*final)
    fig = rep.figure()
    layers = [r for r in rep.rows if r["layer"] is not None]
    for ax in fig.axes:
        keys = [line.get_label() for line in ax.lines if not line.get_label().startswith("_")]
        values = [r[k] for r in layers for k in keys]
        lo, hi = ax.get_ylim()
        span = max(values) - min(values)
        assert lo <= min(values) and max(values) <= hi
        assert hi - lo <= 1.5 * span  # the layers fill the panel: not crushed by the final norm
        off = [r[k] for r in rep.rows if r["layer"] is None for k in keys if not lo <= r[k] <= hi]
        notes = [t.get_text() for t in ax.texts]
        for v in off:  # each off-scale value is written on the panel
            assert any(f"{v:.4g}" in n for n in notes), (v, notes)


def test_lens_figure_draws_a_final_norm_on_scale_as_a_plain_point():
    rep = _lens_report(10.5, 4.5)
    final = rep.rows[-1]
    for ax in rep.figure().axes:
        assert not ax.texts
        lo, hi = ax.get_ylim()
        keys = [line.get_label() for line in ax.lines if not line.get_label().startswith("_")]
        points = [float(line.get_ydata()[0]) for line in ax.lines if len(line.get_ydata()) == 1]
        assert sorted(points) == pytest.approx(sorted(final[k] for k in keys))  # drawn where they are
        assert all(lo <= v <= hi for v in points)


def _overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.parametrize("rows,heads,cell", [(4, 3, 1.5), (2, 2, 1.0), (6, 4, 0.8), (3, 8, 1.5)])
def test_grid_figure_titles_never_overlap_an_image(rows, heads, cell):
    """Row titles ("y=3 pred=5") sit in the gap above their own image, never on the image above, and
    the figure's title clears the first row's column titles."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    titles = [f"y={i} pred={(i + 1) % 10}" for i in range(rows)]
    fig = grid_figure(torch.rand(rows, 1, 8, 8), torch.rand(rows, heads, 4, 4), "memberships pi of each token",
                      "membership pi", False, cell, 60, "viridis", row_titles=titles)
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    grid = [ax for ax in fig.axes if ax.get_images() and ax.get_subplotspec() is not None]
    assert len(grid) == rows * (1 + heads)
    images = [ax.get_window_extent(renderer) for ax in grid]
    texts = [ax.title for ax in grid if ax.get_title()] + [fig._suptitle]
    for t in texts:
        box = t.get_window_extent(renderer)
        own = [im for ax, im in zip(grid, images) if ax.title is t]
        for im in images:
            if not own or im is not own[0]:
                assert not _overlaps(box, im), (t.get_text(), box, im)
    tops = [ax.title.get_window_extent(renderer) for ax in grid[:1 + heads] if ax.get_title()]
    sup = fig._suptitle.get_window_extent(renderer)
    assert all(not _overlaps(sup, t) for t in tops)
