"""One tiny model of every family (vision, LRA, language model) and an input batch for it, for
tests that must cover them all (gradient checkpointing, torch.compile)."""
import torch

from whiteformer.models import create_model

_IMG = dict(img_size=16, patch_size=4, depth=2, num_classes=3)
FAMILIES = {
    "tost_t12_p16": dict(_IMG, embed_dim=32),
    "dmst_t12_p16": dict(_IMG, embed_dim=32),
    "eca_t": dict(_IMG, embed_dim=32, attn_kwargs={"rank": 2}),
    "xcit_s12_p16": dict(_IMG, embed_dim=32),
    "vit_cab_s12_p16": dict(_IMG, embed_dim=24),
    "crate_t": dict(_IMG, embed_dim=32, num_heads=4),
    "deit_t_p16": dict(_IMG, embed_dim=24),
    "tost_lra_listops": dict(vocab_size=20, num_classes=3, max_len=16, embed_dim=16, depth=2, num_heads=2,
                             mlp_dim=32),
    "transformer_lra_listops": dict(vocab_size=20, num_classes=3, max_len=16, embed_dim=16, depth=2, num_heads=2,
                                    mlp_dim=32),
    "tost_lm_base": dict(vocab_size=40, dim=16, depth=2, num_heads=2, max_len=16),
    "gpt_base": dict(vocab_size=40, dim=16, depth=2, num_heads=2, max_len=16),
    "decoder_base": dict(vocab_size=40, dim=16, depth=2, num_heads=2, num_kv_heads=1, intermediate_size=24),
}


def tiny(name: str):
    """(model, inputs tuple, loss function of the model's output) for ``name``."""
    torch.manual_seed(0)
    kwargs = FAMILIES[name]
    model = create_model(name, **kwargs)
    if name.endswith(("_lm_base", "gpt_base", "decoder_base")):
        idx = torch.randint(0, kwargs["vocab_size"], (2, 12))
        return model, (idx, idx), lambda out: out[1]
    if "_lra_" in name:
        tokens = torch.randint(1, kwargs["vocab_size"], (2, 12))
        return model, (tokens,), lambda out: out.logsumexp(-1).mean()
    images = torch.randn(2, 3, kwargs["img_size"], kwargs["img_size"])
    return model, (images,), lambda out: out.logsumexp(-1).mean()
