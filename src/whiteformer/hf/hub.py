"""Uploading a saved model folder to the Hugging Face Hub (``save_pretrained(d, push_to_hub=True)``).

``transformers`` uploads from inside its ``save_pretrained``, before the wrapper has written the
folder's ``whiteformer_auto.py``, timm's ``config.json`` fields and the model card; here the upload
runs once the folder is complete, with ``transformers``' own upload (the files changed since the
save began). The model card: a ``README.md`` the repository already has is left there, unless
whiteformer wrote it (as a README of the user's in the local folder is kept by the save).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Optional

from ..models.model_card import CARD_MARK, CARD_NAME

__all__ = ["push_folder", "file_times"]


def file_times(folder: Path) -> Dict[str, float]:
    """Modification time of each entry of ``folder`` (none when it does not exist yet)."""
    return {f: os.path.getmtime(folder / f) for f in os.listdir(folder)} if folder.is_dir() else {}


def _remote_card(repo_id: str, token: Any) -> Optional[str]:
    """The text of the repository's ``README.md``; None when it has none."""
    from huggingface_hub import ModelCard
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return ModelCard.load(repo_id, token=token).content
    except EntryNotFoundError:
        return None


def push_folder(model, folder: Path, before: Dict[str, float], repo_id: str, *, token: Any = None,
                private: Optional[bool] = None, commit_message: Optional[str] = None,
                create_pr: bool = False):
    """Create ``repo_id`` if needed and upload what ``folder`` gained or changed since ``before``
    (:func:`file_times`), through ``model``'s ``transformers`` upload; returns the commit info."""
    from transformers.utils.hub import hf_api

    repo_id = hf_api().create_repo(repo_id, exist_ok=True, private=private, token=token).repo_id
    times = dict(before)
    card = folder / CARD_NAME
    if card.is_file() and not card.is_symlink():
        remote = _remote_card(repo_id, token)
        if remote is not None and CARD_MARK not in remote:  # the repository's own card stays
            times[CARD_NAME] = os.path.getmtime(card)
    return model._upload_modified_files(folder, repo_id, times, commit_message=commit_message, token=token,
                                        create_pr=create_pr)
