"""The model card (``README.md``) that ``save_pretrained`` writes beside the weights: the Hub's
front matter (``library_name: whiteformer``, license, tags), how to load the folder (whiteformer, timm's
``pretrained_cfg_overlay``, transformers' Auto classes), its
constructor arguments and the paper the model implements (title, authors, arXiv number)."""
from __future__ import annotations

import json
from typing import Any, Dict, Optional, Tuple

__all__ = ["CARD_NAME", "CARD_MARK", "PAPERS", "paper_for", "model_card"]

CARD_NAME = "README.md"
#: the comment that marks a card as written here (a later save replaces it; a user's own README stays)
CARD_MARK = "<!-- model card written by whiteformer's save_pretrained -->"

#: (title, authors, arXiv id or venue) of the papers the zoo implements
PAPERS: Dict[str, Tuple[str, str, str]] = {
    "tost": ("Token Statistics Transformer: Linear-Time Attention via Variational Rate Reduction",
             "Ziyang Wu, Tianjiao Ding, Yifu Lu, Druv Pai, Jingyuan Zhang, Weida Wang, Yaodong Yu, Yi Ma, "
             "Benjamin D. Haeffele", "arXiv:2412.17810"),
    "dmsa": ("Interpretable and Sparse Linear Attention with Decoupled Membership-Subspace Modeling via MCR² "
             "Objective", "Tianyuan Liu, Libin Hou, Linyuan Wang, Bin Yan", "arXiv:2601.17042"),
    "eca": ("ECAttention: Adaptive and Principled Feature Expansion-Compression with Linear Efficiency",
            "anonymous", "OpenReview Z6GFLePzmp"),
    "irratt": ("Vision Transformer with Irregular Attention", "anonymous", "submission under double-blind review"),
}


def paper_for(model_name: Optional[str], init_kwargs: Dict[str, Any]) -> Tuple[str, str, str]:
    """The paper a model implements: DMSA for ``dmst_*``, ECAttention for ``eca_*``, IrrAtt for a
    compressed model, ToST (the zoo's base) otherwise."""
    if init_kwargs.get("compression"):
        return PAPERS["irratt"]
    name = model_name or ""
    return PAPERS["dmsa"] if name.startswith("dmst") else PAPERS["eca"] if name.startswith("eca") else PAPERS["tost"]


def model_card(config: Dict[str, Any], num_params: int, extra: str = "") -> str:
    """The card's text for a model whose ``config.json`` is ``config``; ``extra`` (markdown, e.g. the
    training command's configuration and metrics) goes before the paper."""
    name = config.get("model_name") or config.get("architecture") or "model"
    args = config.get("init_kwargs", {})
    title, authors, where = paper_for(config.get("model_name"), args)
    task = "text-generation" if "vocab_size" in args else "image-classification"
    auto = "AutoModelForCausalLM" if task == "text-generation" else "AutoModelForImageClassification"
    hf_use = "" if not config.get("auto_map") else f"""
# with transformers alone (the folder's code imports whiteformer):
# from transformers import {auto}
# model = {auto}.from_pretrained("org/name", trust_remote_code=True)"""
    return f"""---
library_name: whiteformer
license: apache-2.0
pipeline_tag: {task}
tags:
- whiteformer
- {task}
---
{CARD_MARK}
# {name}

A whiteformer `{name}` model ({num_params:,} parameters).

## Use

```python
import whiteformer

model = whiteformer.from_pretrained("path/to/this/folder")
# from the Hub, as in timm:
# model = whiteformer.create_model("{name}", pretrained=True, pretrained_cfg_overlay=dict(hf_hub_id="org/name")){hf_use}
```

## Constructor arguments

```json
{json.dumps(args, indent=2, sort_keys=True)}
```
{extra}
## Paper

{authors}. *{title}.* {where}.
"""
