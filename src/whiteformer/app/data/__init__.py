"""Offline datasets (nothing is downloaded at run time) behind a name registry.

===================== ==========================================================================================
name                  what (``help=`` of its ``register_dataset``)
===================== ==========================================================================================
``digits``            scikit-learn's bundled 8x8 handwritten digits (1797), fixed stratified split
``image-folder``      class-per-subfolder images read with Pillow (data_dir[/split]/class/*.png)
``listops``           Long-Range-Arena ListOps expressions from the task's grammar (generated)
``mnist``             MNIST from the standard IDX files (raw or .gz) in data_dir
``mnist-pixels``      sequential MNIST: 784 pixel tokens per image (LRA Image stand-in), IDX files in data_dir
``pathfinder``        generated two-dot / dashed-path images read as pixel tokens (LRA Pathfinder)
``shakespeare-pairs`` whether two byte-level documents come from the same play (LRA Retrieval stand-in)
``shakespeare-plays`` which play a byte-level document comes from (LRA Text / IMDB stand-in)
``subspaces``         synthetic union of K orthogonal subspaces (ECA toy data), class = subspace
``text``              language modelling on a text file: characters or a BPE tokenizer (default: shipped corpus)
``tokens``            language modelling on token ids: nanoGPT's train.bin / val.bin token files in data_dir
===================== ==========================================================================================

``build_dataset(name, split, **kwargs)`` checks the arguments (:func:`check_dataset_args`: names the
builder takes, a ``data_dir`` that fits what the dataset ``reads``) and returns a dataset with
``get_batch(indices)`` and the metadata models need (see :mod:`whiteformer.app.data.base`);
``list_datasets()`` lists the names, ``dataset_info(name)`` what was registered with them
(:mod:`.registry`; tests/app/data/test_data.py checks this table against it).
Optional dependencies are imported lazily: ``digits`` needs scikit-learn, ``image-folder``
Pillow and ``text``'s subword tokenizers ``tokenizers`` (``pip install whiteformer[data]``).
"""
from __future__ import annotations

from .base import ArrayDataset, FileImageDataset, SequenceDataset  # noqa: F401
from .registry import (DATASETS, READS, build_dataset, check_dataset_args, check_split, dataset_builder,  # noqa: F401
                       dataset_info, list_datasets, register_dataset)

__all__ = ["build_dataset", "list_datasets", "register_dataset", "dataset_builder", "dataset_info",
           "check_dataset_args", "DATASETS", "READS", "ArrayDataset", "FileImageDataset", "SequenceDataset"]

# Registration (each module decorates its builder).
from . import digits, image_folder, listops, mnist, pathfinder, plays, subspaces, text, tokens  # noqa: E402,F401
