"""Uploading a saved model folder to the Hugging Face Hub (``save_pretrained(d, push_to_hub=True)``,
``push_to_hub(repo_id)`` of the transformers wrappers).

``transformers`` uploads from inside its ``save_pretrained``, before the wrapper has written the
folder's ``whiteformer_auto.py``, timm's ``config.json`` fields and the model card, and its
``push_to_hub`` replaces the card by the repository's or a default one. Here the upload runs once the
folder is complete, through ``huggingface_hub`` (one commit of the files changed since the save began).
The model card: whiteformer's (with the caller's ``tags``), unless the repository already has a
``README.md`` that whiteformer did not write: that one stays (re-tagged by ``transformers``' own
function when ``tags`` are given).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

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


def _card(folder: Path, repo_id: str, token: Any, tags: Optional[Sequence[str]]) -> bool:
    """Settle ``folder``'s model card before the upload; whether to upload it."""
    from huggingface_hub import ModelCard

    path = folder / CARD_NAME
    if path.is_symlink() or not path.is_file():
        return False
    remote = _remote_card(repo_id, token)
    if remote is not None and CARD_MARK not in remote:  # the repository's own card stays
        if not tags:
            return False
        from transformers.utils.hub import create_and_tag_model_card

        create_and_tag_model_card(repo_id, list(tags), token=token).save(path)
        return True
    if tags:
        card = ModelCard(path.read_text(encoding="utf-8"))
        card.data.tags = list(card.data.tags or []) + [t for t in tags if t not in (card.data.tags or [])]
        card.save(path)
    return True


def push_folder(folder: Path, before: Dict[str, float], repo_id: str, *, token: Any = None,
                private: Optional[bool] = None, commit_message: Optional[str] = None,
                commit_description: Optional[str] = None, create_pr: bool = False,
                revision: Optional[str] = None, tags: Optional[Sequence[str]] = None):
    """Create ``repo_id`` if needed and upload, in one commit, what ``folder`` gained or changed since
    ``before`` (:func:`file_times`) and its model card (module docstring). Returns the commit info."""
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi()
    repo_id = api.create_repo(repo_id, exist_ok=True, private=private, token=token).repo_id
    upload_card = _card(folder, repo_id, token, tags)
    names = [f for f in sorted(os.listdir(folder))
             if (f not in before or os.path.getmtime(folder / f) > before[f]) and f != CARD_NAME]
    names += [CARD_NAME] if upload_card else []
    ops = [CommitOperationAdd(path_in_repo=p.relative_to(folder).as_posix(), path_or_fileobj=str(p))
           for f in names for p in ([folder / f] if (folder / f).is_file() else sorted((folder / f).rglob("*")))
           if p.is_file()]
    if revision is not None and not revision.startswith("refs/pr"):
        api.create_branch(repo_id=repo_id, branch=revision, token=token, exist_ok=True)
    return api.create_commit(repo_id=repo_id, operations=ops, commit_message=commit_message or "Upload model",
                             commit_description=commit_description, token=token, create_pr=create_pr,
                             revision=revision)
