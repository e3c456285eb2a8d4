"""Official ToST / nanoGPT language-model checkpoints onto a :class:`~whiteformer.models.lm.CausalLM`'s keys."""
from __future__ import annotations

from typing import Dict

import torch

__all__ = ["LMStateDictConversion"]


class LMStateDictConversion:
    """:meth:`convert_state_dict` of a :class:`~whiteformer.models.lm.CausalLM`."""

    def convert_state_dict(self, state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Map an official ToST / nanoGPT language-model state_dict (``_orig_mod.`` stripped by
        the loader) onto this model's keys; own keys pass unchanged.

        - ``transformer.h.{i}.attn.c_attn`` / ``c_proj`` / ``denom_bias`` -> ``qkv`` / ``proj`` /
          ``pos_bias``; nanoGPT's causal-mask buffer ``attn.bias`` (4-D) is dropped;
        - a missing ``lm_head.weight`` or ``transformer.wte.weight`` is filled from the other (tied);
        - ``wpe`` / ``pos_bias`` longer than this model's ``max_len`` are cropped to it (as
          nanoGPT ``crop_block_size``); a position embedding or a non-zero position bias the model
          does not have raises ``ValueError`` (all-zero position biases are dropped).
        """
        out: Dict[str, torch.Tensor] = {}
        for key, val in state_dict.items():
            new = key
            if ".attn." in key:
                head, tail = key.rsplit(".attn.", 1)
                if tail == "bias" and val.dim() == 4:
                    continue  # nanoGPT causal mask buffer
                tail = {"c_attn.weight": "qkv.weight", "c_attn.bias": "qkv.bias",
                        "c_proj.weight": "proj.weight", "c_proj.bias": "proj.bias",
                        "denom_bias": "pos_bias"}.get(tail, tail)
                new = f"{head}.attn.{tail}"
            out[new] = val
        if "lm_head.weight" not in out and "transformer.wte.weight" in out:
            out["lm_head.weight"] = out["transformer.wte.weight"]
        if "transformer.wte.weight" not in out and "lm_head.weight" in out:
            out["transformer.wte.weight"] = out["lm_head.weight"]
        wpe = out.get("transformer.wpe.weight")
        if wpe is not None:
            if not self.has_pos_emb:
                raise ValueError("checkpoint has a learned position embedding (transformer.wpe.weight) but the "
                                 "model was built with pos_emb=False")
            if wpe.shape[0] > self.max_len:
                out["transformer.wpe.weight"] = wpe[: self.max_len]
        modules = dict(self.named_modules())
        for key in [k for k in out if k.endswith(".attn.pos_bias")]:
            val, mod = out[key], modules.get(key[: -len(".pos_bias")])
            if mod is None:
                continue  # unknown module: the strict load reports it
            if getattr(mod, "pos_bias", None) is None:
                if bool((val != 0).any()):
                    raise ValueError(f"checkpoint has a non-zero position bias {key} but the model was built "
                                     f"with pos_bias=False")
                del out[key]
            elif val.dim() == 3 and val.shape[1] > mod.pos_bias.shape[1]:
                out[key] = val[:, : mod.pos_bias.shape[1]]
        return out
