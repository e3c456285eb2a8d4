"""Experiment 8: every attention as a drop-in in a plain ViT on MNIST, with and without a readout.

A user's own TinyViT: 4x4 patches of the 28x28 digits (49 tokens), width 64,
depth 4, 4 heads, learned absolute positions, pre-norm blocks with a GELU MLP (ratio 4,
:class:`whiteformer.layers.ViTBlock`), then a readout and a linear head. Readouts:

* ``cls``  -- a [CLS] token carried through the blocks, read at the end (plain ViT);
* ``mean`` -- the mean of the final tokens;
* ``pool`` -- :class:`whiteformer.layers.ClassAttentionPool` (one class-attention layer after
  the blocks: a learned query attends to the final tokens);

and ``+lpi``: XCiT's local patch interaction in every block (:class:`whiteformer.layers.LocalPatchInteraction`).
Every run: AdamW (lr, weight decay 0.05 except norms, biases, positions, tokens), linear warm-up
then cosine decay, the first ``train_limit`` training images, the first ``test_limit`` test images,
single-threaded, seed 0. A finished run leaves ``result.json`` in its run directory and is skipped
next time (re-run to continue after an interruption or the time budget).

Writes ``experiments/results/exp8_plain_vit/{runs.csv, results.json}``.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

NAME = "exp8_plain_vit"
READOUTS = ("cls", "mean", "pool")


class TinyViT(nn.Module):
    """Conv patch embedding + learned positions + ``depth`` ViTBlocks + readout + linear head.
    Images (B, in_chans, H, W) -> logits (B, num_classes)."""

    def __init__(self, attn: str, readout: str, lpi: bool = False, img_size: int = 28, patch_size: int = 4,
                 in_chans: int = 1, num_classes: int = 10, dim: int = 64, depth: int = 4, num_heads: int = 4,
                 mlp_ratio: float = 4.0, attn_kwargs=None):
        from whiteformer.layers import ClassAttentionPool, ViTBlock

        super().__init__()
        if readout not in READOUTS:
            raise ValueError(f"readout must be one of {READOUTS}, got {readout!r}")
        self.readout, self.grid = readout, (img_size // patch_size, img_size // patch_size)
        self.patch_embed = nn.Conv2d(in_chans, dim, patch_size, stride=patch_size)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.grid[0] * self.grid[1], dim))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if readout == "cls" else None
        self.blocks = nn.ModuleList(
            ViTBlock(dim, num_heads, attn=attn, attn_kwargs=attn_kwargs, mlp_ratio=mlp_ratio, lpi=lpi)
            for _ in range(depth)
        )
        self.pool = ClassAttentionPool(dim, num_heads, depth=1) if readout == "pool" else None
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.trunc_normal_(self.cls_token, std=0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2) + self.pos_embed
        prefix = 0
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
            prefix = 1
        for blk in self.blocks:
            x = blk(x, grid_size=self.grid, num_prefix_tokens=prefix)
        if self.readout == "pool":
            return self.head(self.pool(x))  # the pool normalises its output
        feats = x[:, 0] if self.readout == "cls" else x.mean(dim=1)
        return self.head(self.norm(feats))


def _param_groups(model: nn.Module, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or name.endswith(("pos_embed", "cls_token")) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def _accuracy(model: nn.Module, ds, n: int, batch_size: int = 500) -> float:
    model.eval()
    correct = 0
    for i in range(0, n, batch_size):
        x, y = ds.get_batch(torch.arange(i, min(i + batch_size, n)))
        correct += (model(x).argmax(-1) == y).sum().item()
    return correct / n


def train_one(run_dir: Path, attn: str, readout: str, lpi: bool, train_ds, test_ds, cfg: dict) -> dict:
    done = C.read_json(run_dir / "result.json")
    if done is not None:
        return done
    seed = int(cfg.get("seed", 0))
    torch.manual_seed(seed)
    m = cfg["model"]
    model = TinyViT(attn, readout, lpi=lpi, img_size=m["img_size"], patch_size=m["patch_size"],
                    in_chans=m["in_chans"], dim=m["dim"], depth=m["depth"], num_heads=m["num_heads"],
                    attn_kwargs=cfg.get("attn_kwargs", {}).get(attn))
    t = cfg["train"]
    n_train = len(train_ds)
    steps_per_epoch = math.ceil(n_train / t["batch_size"])
    total = steps_per_epoch * t["epochs"]
    opt = torch.optim.AdamW(_param_groups(model, t["weight_decay"]), lr=t["lr"])
    warm = min(t["warmup_steps"], total)

    def lr_at(step: int) -> float:
        if step < warm:
            return t["lr"] * (step + 1) / warm
        frac = (step - warm) / max(1, total - warm)
        return t["min_lr"] + 0.5 * (t["lr"] - t["min_lr"]) * (1 + math.cos(math.pi * frac))

    gen = torch.Generator().manual_seed(seed)
    step, start, losses = 0, time.time(), []
    for _ in range(t["epochs"]):
        model.train()
        order = torch.randperm(n_train, generator=gen)
        for i in range(0, n_train, t["batch_size"]):
            x, y = train_ds.get_batch(order[i:i + t["batch_size"]])
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            step += 1
    train_time = time.time() - start
    n_test = len(test_ds)
    res = {"attn": attn, "readout": readout, "lpi": lpi, "seed": seed, "steps": step, "epochs": t["epochs"],
           "train_images": n_train, "test_images": n_test, "params": C.num_params(model),
           "test_acc": _accuracy(model, test_ds, n_test), "train_acc": _accuracy(model, train_ds, min(n_train, n_test)),
           "final_train_loss": sum(losses[-20:]) / len(losses[-20:]), "train_time_s": train_time}
    C.write_json(run_dir / "result.json", res)
    return res


def _warm_up(cfg: dict) -> None:
    """One forward/backward per attention before any timing (one-time kernel builds/loads)."""
    from whiteformer.layers import ViTBlock

    m = cfg["model"]
    n = (m["img_size"] // m["patch_size"]) ** 2
    for attn in dict.fromkeys(spec["attn"] for spec in cfg["runs"]):
        blk = ViTBlock(m["dim"], m["num_heads"], attn=attn, attn_kwargs=cfg.get("attn_kwargs", {}).get(attn))
        blk(torch.randn(2, n, m["dim"])).sum().backward()


def main(argv=None) -> int:
    from whiteformer.app.data import build_dataset

    p = C.parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--data", default=None, help="MNIST directory with the four IDX files (default: config's data_dir, "
                                                "else the data folder's mnist/); smoke runs use scikit-learn's digits")
    args = p.parse_args(argv)
    setup = C.Setup(NAME, args)
    cfg = setup.cfg
    torch.set_num_threads(1)
    if cfg["dataset"] == "mnist":
        data_dir = args.data or cfg.get("data_dir") or str(C.MNIST_DIR)
        train_ds = build_dataset("mnist", "train", data_dir=data_dir, limit=cfg["train_limit"])
        test_ds = build_dataset("mnist", "test", data_dir=data_dir, limit=cfg["test_limit"])
    else:
        train_ds, test_ds = build_dataset(cfg["dataset"], "train"), build_dataset(cfg["dataset"], "test")
    _warm_up(cfg)
    rows = []
    for spec in cfg["runs"]:
        attn, readout = spec["attn"], spec["readout"]
        lpi = bool(spec.get("lpi", False))
        key = f"{attn}_{readout}" + ("_lpi" if lpi else "")
        rd = setup.runs / key
        if C.read_json(rd / "result.json") is None and not setup.time_left():
            print(f"[{NAME}] time budget reached; not starting {key} (re-run to continue)")
            continue
        print(f"[{NAME}] {key} -> {rd}", flush=True)
        res = train_one(rd, attn, readout, lpi, train_ds, test_ds, cfg)
        rows.append({"name": key, **{k: res[k] for k in ("attn", "readout", "lpi", "params", "test_acc", "train_acc",
                                                         "final_train_loss", "train_time_s")}})
        print(f"[{NAME}]   test acc {res['test_acc'] * 100:.2f} % ({res['train_time_s']:.0f} s)", flush=True)
    C.write_csv(setup.out / "runs.csv", rows)
    command = setup.command(NAME) + ("" if setup.smoke else " --data DATA_DIR/mnist")
    C.write_json(setup.out / "results.json", {"config": cfg, "command": command, "runs": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
