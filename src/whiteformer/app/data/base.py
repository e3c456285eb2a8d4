"""Dataset containers shared by the loaders: in-memory image/vector classification
(:class:`ArrayDataset`), lazily read image files (:class:`FileImageDataset`), token sequences
with one label each (:class:`SequenceDataset`) and character-level text (``text.CharCorpus``).

Every dataset has ``kind`` ("image", "vector", "sequence", "tokens" or "lm": the kinds a task is
registered for, :func:`whiteformer.app.train.tasks.task_class`) and the metadata a model needs
(``num_classes``, ``in_chans``, ``img_size``, ``vocab_size``, ...). Batches are fetched with
``get_batch(indices, transform=None)``: the trainer chooses the indices (the data order is a
function of the seed and the epoch) and the optional ``transform`` (augmentation) acts on the
images scaled to [0, 1], before the per-channel normalisation. Image datasets also take
``crop=(RandomResizedCrop, params)``: random resized crops, taken from the files' own pixels where
the images are files (:mod:`.resized_crop`).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .images import read_image

__all__ = ["ArrayDataset", "FileImageDataset", "SequenceDataset", "resize_images", "stratified_split"]

Transform = Optional[Callable[[torch.Tensor], torch.Tensor]]


def resize_images(x: torch.Tensor, size: Optional[Tuple[int, int]]) -> torch.Tensor:
    """Bilinear resize (antialiased when shrinking) of (N, C, H, W) float images to ``size``."""
    if size is None or tuple(x.shape[-2:]) == tuple(size):
        return x
    shrink = size[0] < x.shape[-2] or size[1] < x.shape[-1]
    return F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=shrink)


def stratified_split(labels: torch.Tensor, test_fraction: float, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Fixed stratified split: per class, a seeded permutation; the first ``round(n_c * f)`` go
    to the test split. Returns sorted (train_indices, test_indices)."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    g = torch.Generator().manual_seed(seed)
    train, test = [], []
    for c in torch.unique(labels).tolist():
        idx = torch.nonzero(labels == c).flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        k = int(round(len(idx) * test_fraction))
        test.append(idx[:k])
        train.append(idx[k:])
    return torch.sort(torch.cat(train)).values, torch.sort(torch.cat(test)).values


def _as_size(img_size) -> Optional[Tuple[int, int]]:
    if img_size is None:
        return None
    if isinstance(img_size, bool):
        raise TypeError(f"img_size must be an int or a pair of ints, got {img_size!r}")
    if isinstance(img_size, int):
        img_size = (img_size, img_size)
    size = tuple(int(s) for s in img_size)
    if len(size) != 2 or min(size) <= 0:
        raise ValueError(f"img_size must be a positive int or a pair of positive ints, got {img_size!r}")
    return size  # type: ignore[return-value]


class ArrayDataset(torch.utils.data.Dataset):
    """In-memory classification data.

    Args:
        data: images (N, C, H, W) (``kind="image"``) or vectors (N, D) (``kind="vector"``), as
            uint8 (divided by ``scale``) or float.
        labels: (N,) integer class indices in [0, num_classes).
        num_classes: number of classes.
        mean, std: per-channel normalisation applied after the transform (length C, or 1).
        scale: the stored values are divided by it (255 for uint8 images).
        img_size: resize images to this size at fetch time (None: keep).
        classes: class names (default "0", "1", ...).

    ``get_batch(indices, transform, crop=None)`` -> (x float32 (B, C, H, W) or (B, D), y int64 (B,));
    ``crop``: (:class:`~.resized_crop.RandomResizedCrop`, its parameters for these images).
    """

    def __init__(self, data: torch.Tensor, labels: torch.Tensor, num_classes: int, *, kind: str = "image",
                 mean: Sequence[float] = (0.0,), std: Sequence[float] = (1.0,), scale: float = 1.0,
                 img_size=None, classes: Optional[List[str]] = None, name: str = "array"):
        if kind not in ("image", "vector"):
            raise ValueError(f"kind must be 'image' or 'vector', got {kind!r}")
        want = 4 if kind == "image" else 2
        if data.dim() != want:
            raise ValueError(f"{name}: data must have {want} dims for kind={kind!r}, got shape {tuple(data.shape)}")
        if labels.shape != (data.shape[0],):
            raise ValueError(f"{name}: labels must have shape ({data.shape[0]},), got {tuple(labels.shape)}")
        if len(labels) == 0:
            raise ValueError(f"{name}: the dataset is empty")
        self.name = name
        self.kind = kind
        self.data = data
        self.labels = labels.long()
        self.num_classes = int(num_classes)
        self.classes = classes if classes is not None else [str(i) for i in range(self.num_classes)]
        self.scale = float(scale)
        self._size = _as_size(img_size) if kind == "image" else None
        self.in_chans = data.shape[1] if kind == "image" else 1
        c = self.in_chans if kind == "image" else 1
        self.mean = torch.as_tensor(mean, dtype=torch.float32).reshape(-1)
        self.std = torch.as_tensor(std, dtype=torch.float32).reshape(-1)
        if self.mean.numel() not in (1, c) or self.std.numel() not in (1, c):
            raise ValueError(f"{name}: mean/std must have 1 or {c} entries")

    @property
    def img_size(self) -> Optional[Tuple[int, int]]:
        if self.kind != "image":
            return None
        return self._size or (int(self.data.shape[2]), int(self.data.shape[3]))

    @property
    def dim(self) -> int:
        """Feature dimension of vector data."""
        return int(self.data.shape[-1])

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, i: int):
        x, y = self.get_batch(torch.tensor([i]))
        return x[0], y[0]

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        shape = (1, -1, 1, 1) if self.kind == "image" else (1, -1)
        return (x - self.mean.reshape(shape)) / self.std.reshape(shape)

    def get_batch(self, indices: torch.Tensor, transform: Transform = None, crop=None) -> Tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        x = self.data[idx].float()
        if self.scale != 1.0:
            x = x / self.scale
        if self.kind == "image":
            x = resize_images(x, self._size)
            if crop is not None:
                x = crop[0].apply(x, crop[1])
        if transform is not None:
            x = transform(x)
        return self.normalize(x), self.labels[idx]

    def label_counts(self) -> torch.Tensor:
        return torch.bincount(self.labels, minlength=self.num_classes)


class FileImageDataset(ArrayDataset):
    """Images read from files with Pillow at fetch time (``preload`` reads them all once).

    ``files``: list of paths; ``labels`` (N,); images converted to "L" (in_chans 1) or "RGB" (3)
    and resized to ``img_size`` (required: files may differ in size), or with ``crop_pct``, resized
    to ``img_size / crop_pct`` and centre-cropped to ``img_size`` (timm's evaluation transform).
    """

    def __init__(self, files: List[str], labels: torch.Tensor, num_classes: int, img_size, in_chans: int,
                 classes: List[str], mean, std, preload: bool = False, name: str = "image-folder",
                 crop_pct: Optional[float] = None):
        size = _as_size(img_size)
        if size is None:
            raise ValueError(f"{name}: img_size is required (image files may differ in size)")
        self.files = list(files)
        placeholder = torch.zeros(len(files), in_chans, 1, 1, dtype=torch.uint8)
        super().__init__(placeholder, labels, num_classes, kind="image", mean=mean, std=std, scale=255.0,
                         img_size=size, classes=classes, name=name)
        self.in_chans = in_chans
        self.crop_pct = crop_pct
        self._cache: Optional[torch.Tensor] = None
        if preload:
            self._cache = self._read(range(len(self.files)))

    def _read(self, idx, crop=None) -> torch.Tensor:
        mode = "L" if self.in_chans == 1 else "RGB"
        boxes = [None] * len(idx) if crop is None else \
            [lambda h, w, j=j: crop[0].box(crop[1], j, h, w) for j in range(len(idx))]
        return torch.stack([read_image(self.files[i], mode, self._size, self.crop_pct, box)
                            for i, box in zip(idx, boxes)])

    def get_batch(self, indices: torch.Tensor, transform: Transform = None, crop=None) -> Tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        if self._cache is not None:
            x = self._cache[idx].float() / 255.0
            if crop is not None:
                x = crop[0].apply(x, crop[1])
        else:
            x = self._read(idx.tolist(), crop).float() / 255.0
        if transform is not None:
            x = transform(x)
        return self.normalize(x), self.labels[idx]


class SequenceDataset(torch.utils.data.Dataset):
    """Token sequences with one class label each (ListOps, pixel sequences, text; pairs for retrieval).

    ``tokens`` (N, L) int64 padded with ``pad_id`` on the right, or (N, 2, L) for two-document
    examples (``pair``: Retrieval); ``lengths`` (N,) or (N, 2); ``labels`` (N,). ``pad_id=None``:
    the sequences are never padded (pixel sequences, where id 0 is a real pixel value).
    ``get_batch(indices)`` -> (tokens (B, L) or (B, 2, L), labels (B,)); ``vocab`` lists the token
    strings. ``kind``: "sequence" (labels are tokens of the vocabulary, e.g. ListOps digits: a
    language model can answer with the next token, or a sequence classifier reads them) or
    "tokens" (pixels, bytes, pairs: only a sequence classifier, ``tost_lra_*``, reads them).
    """

    def __init__(self, tokens: torch.Tensor, lengths: torch.Tensor, labels: torch.Tensor, num_classes: int,
                 vocab: List[str], pad_id: Optional[int] = 0, name: str = "sequence",
                 classes: Optional[List[str]] = None, kind: str = "sequence"):
        ok = (tokens.dim() == 2 or (tokens.dim() == 3 and tokens.shape[1] == 2))
        if not ok or lengths.shape != tokens.shape[:-1] or labels.shape != (tokens.shape[0],):
            raise ValueError(f"{name}: expected tokens (N, L) or (N, 2, L), lengths (N,) or (N, 2), labels (N,), got "
                             f"{tuple(tokens.shape)}, {tuple(lengths.shape)}, {tuple(labels.shape)}")
        if kind not in ("sequence", "tokens"):
            raise ValueError(f"{name}: kind must be 'sequence' or 'tokens', got {kind!r}")
        self.name, self.kind = name, kind
        self.tokens = tokens.long()
        self.lengths = lengths.long()
        self.labels = labels.long()
        self.num_classes = int(num_classes)
        self.vocab = list(vocab)
        self.vocab_size = len(self.vocab)
        self.pad_id = pad_id
        self.pair = tokens.dim() == 3
        self.classes = list(classes) if classes is not None else [str(i) for i in range(self.num_classes)]

    @property
    def max_len(self) -> int:
        return int(self.tokens.shape[-1])

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, i: int):
        return self.tokens[i], self.labels[i]

    def get_batch(self, indices: torch.Tensor, transform: Transform = None) -> Tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return self.tokens[idx], self.labels[idx]

    def label_counts(self) -> torch.Tensor:
        return torch.bincount(self.labels, minlength=self.num_classes)

    def decode(self, ids) -> str:
        return " ".join(self.vocab[int(i)] for i in ids if self.pad_id is None or int(i) != self.pad_id)
