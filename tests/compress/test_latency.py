"""Interleaved latency of two models: medians, interquartile ranges, and no ratio when they overlap."""
import random
import statistics

import pytest
import torch
import torch.nn as nn

from whiteformer.compress import compare_latency, compress
from whiteformer.compress.latency import latency_verdict, summarize_pair
from whiteformer.compress.report import latency_line
from whiteformer.models import create_model


class FakeClock:
    """A clock that only moves when a :class:`Sleeper` runs."""

    def __init__(self):
        self.now = 0.0
        self.calls = []

    def __call__(self) -> float:
        return self.now


class Sleeper(nn.Module):
    """A 'model' whose forward advances the fake clock by the next scripted duration."""

    def __init__(self, name, clock, durations):
        super().__init__()
        self.name, self.clock, self.durations = name, clock, list(durations)

    def forward(self, x):
        self.clock.calls.append(self.name)
        self.clock.now += self.durations.pop(0)
        return x


def scripted(seed, n, centre_a, centre_b, jitter, warmup):
    rng = random.Random(seed)
    a = [centre_a + rng.uniform(-jitter, jitter) for _ in range(n + warmup)]
    b = [centre_b + rng.uniform(-jitter, jitter) for _ in range(n + warmup)]
    return a, b


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_separated_timings_give_the_paired_ratio(seed):
    runs, warmup = 15, 2
    a, b = scripted(seed, runs, 0.040, 0.020, 0.004, warmup)
    clock = FakeClock()
    lat = compare_latency(Sleeper("a", clock, a), Sleeper("b", clock, b), torch.zeros(3, 1), runs=runs,
                          warmup=warmup, timer=clock)
    assert clock.calls == ["a", "b"] * (runs + warmup)  # interleaved, warm-up included
    ta, tb = a[warmup:], b[warmup:]
    assert lat["before_ms"] == pytest.approx(1e3 * statistics.median(ta))
    assert lat["after_ms"] == pytest.approx(1e3 * statistics.median(tb))
    assert lat["speedup"] == pytest.approx(statistics.median([x / y for x, y in zip(ta, tb)]))
    lo, hi = lat["speedup_iqr"]
    assert lo <= lat["speedup"] <= hi
    assert not lat["overlap"] and lat["before_iqr_ms"][0] > lat["after_iqr_ms"][1]
    assert lat["batch_size"] == 3 and lat["runs"] == runs and lat["threads"] == torch.get_num_threads()
    text = latency_verdict(lat)
    assert "no measured" not in text and f"x{lat['speedup']:.2f}" in text


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_overlapping_timings_report_no_speed_up(seed):
    # the same distribution, but b's median is lower by chance: a ratio would claim a speed-up
    a, b = scripted(seed, 11, 0.030, 0.029, 0.006, 1)
    clock = FakeClock()
    lat = compare_latency(Sleeper("a", clock, a), Sleeper("b", clock, b), torch.zeros(1, 1), runs=11, warmup=1,
                          timer=clock)
    assert lat["overlap"] and lat["speedup"] is None
    assert lat["ratio"] == pytest.approx(statistics.median([x / y for x, y in zip(a[1:], b[1:])]))
    assert latency_verdict(lat).startswith("no measured speed-up")
    lat.update(warmup=1)
    assert "no measured speed-up" in latency_line(lat) and "x1." not in latency_line(lat)


def test_summarize_pair_overlap_is_symmetric_and_slow_down_is_named():
    fast, slow = [0.010, 0.011, 0.012, 0.013], [0.020, 0.021, 0.022, 0.024]
    s = summarize_pair(slow, fast)
    assert not s["overlap"] and s["speedup"] > 1
    t = summarize_pair(fast, slow)
    assert not t["overlap"] and t["speedup"] < 1
    lat = dict(speedup=t["speedup"], speedup_iqr=t["ratio_iqr"])
    assert "slow-down" in latency_verdict(lat)
    with pytest.raises(ValueError, match="same non-zero number"):
        summarize_pair(fast, slow[:2])


def test_real_measurement_of_a_much_heavier_model():
    """Real clocks: a 6-layer 384-wide MLP against a single 8-wide linear on one thread."""
    torch.manual_seed(0)
    heavy = nn.Sequential(nn.Linear(8, 384), *[nn.Linear(384, 384) for _ in range(6)], nn.Linear(384, 8))
    light = nn.Linear(8, 8)
    threads = torch.get_num_threads()
    heavy.train()
    lat = compare_latency(heavy, light, torch.randn(256, 8), runs=9, warmup=1, threads=1)
    assert torch.get_num_threads() == threads and heavy.training  # restored
    assert lat["threads"] == 1 and lat["order"] == "interleaved"
    assert lat["before_iqr_ms"][0] <= lat["before_ms"] <= lat["before_iqr_ms"][1]
    assert not lat["overlap"] and lat["speedup"] > 2


def test_compress_reports_interleaved_latency():
    torch.manual_seed(0)
    model = create_model("deit_t_p16", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2,
                         num_classes=3)
    _, rep = compress(model, qk="truncatt", qk_rank=4, latency_batch=2, latency_runs=5, latency_threads=1)
    lat = rep.latency
    assert lat["threads"] == 1 and lat["runs"] == 5 and lat["order"] == "interleaved"
    assert (lat["speedup"] is None) == lat["overlap"]
    md = rep.to_markdown()
    assert "interleaved" in md and "IQR" in md
    assert ("no measured speed-up" in md) == lat["overlap"]
    assert rep.to_dict()["latency"]["before_iqr_ms"] == lat["before_iqr_ms"]


def test_compare_latency_checks_its_arguments():
    m = nn.Identity()
    with pytest.raises(ValueError, match="runs"):
        compare_latency(m, m, torch.zeros(1), runs=0)
    with pytest.raises(ValueError, match="threads"):
        compare_latency(m, m, torch.zeros(1), threads=0)
    with pytest.raises(TypeError, match="x must be"):
        compare_latency(m, m, [1.0])


@pytest.mark.parametrize("arg, value, what", [("latency_batch", 0, "a positive integer"),
                                              ("latency_runs", 0, "a positive integer"),
                                              ("latency_warmup", -1, "a non-negative integer"),
                                              ("latency_threads", 0, "a positive integer")])
def test_compress_checks_its_latency_arguments_by_their_own_names(monkeypatch, arg, value, what):
    """compress() refuses a bad latency setting before it compresses anything, naming the argument
    the caller gave (not the batch_size / runs of the function measuring)."""
    import whiteformer.compress.model as compress_model

    model = create_model("deit_t_p16", img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2,
                         num_classes=3)
    monkeypatch.setattr(compress_model, "collect_block_inputs", None)  # no compression work before the check
    kwargs = {"latency_batch": 1, arg: value}
    with pytest.raises(ValueError, match=rf"^{arg} must be {what}, got {value}$"):
        compress(model, qk="truncatt", qk_rank=4, **kwargs)
