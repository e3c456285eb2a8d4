"""File formats the models read and write, with no dependency on transformers: a ViT/DeiT
checkpoint's key layout (:mod:`.vit_weights`) and the remote-code module a saved folder names in
its ``auto_map`` (:mod:`.remote_code`)."""

__all__: list = []
