"""Context parallelism for modules: a layer or model that runs on one contiguous chunk of a
sequence split over a ``torch.distributed`` process group (see
:mod:`whiteformer.ops.context_parallel` for what is communicated and why it is exact).

``module.set_context_parallel(group)`` is the one switch: it sets the group on the module and on
every :class:`ContextParallel` module inside it (``None`` switches back to one process). Copies
of the module (``copy.deepcopy``, e.g. an EMA) share the group; pickling drops it.
"""
from __future__ import annotations

import torch.nn as nn

from ..ops.context_parallel import check_group

__all__ = ["ContextParallel"]


class _GroupRef:
    """Holds a process group: copies share it (a ProcessGroup cannot be copied), pickles drop it."""

    __slots__ = ("group",)

    def __init__(self, group=None):
        self.group = group

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (_GroupRef, ())


_NONE = _GroupRef()


class ContextParallel:
    """Mixin for an ``nn.Module`` that can run context-parallel (see the module docstring).

    Subclasses read :attr:`context_parallel_group` in ``forward`` and may override
    :meth:`check_context_parallel` to refuse (``ValueError``) what they cannot split exactly.
    """

    _cp_ref: _GroupRef = _NONE

    @property
    def context_parallel_group(self):
        """The process group this module's sequence is split over, or None."""
        return self._cp_ref.group

    def check_context_parallel(self) -> None:
        """Raise ``ValueError`` if this module cannot run on a split sequence (default: it can)."""

    def set_context_parallel(self, group) -> "ContextParallel":
        """Split the sequence over ``group`` (a ``torch.distributed`` ProcessGroup; each rank then
        passes its contiguous chunk of the tokens, rank order = sequence order) or ``None``
        (one process). Applies to every :class:`ContextParallel` submodule; returns ``self``."""
        if group is not None:
            check_group(group)
        modules = self.modules() if isinstance(self, nn.Module) else [self]
        targets = [m for m in modules if isinstance(m, ContextParallel)]
        if group is not None:
            for m in targets:
                m.check_context_parallel()
        ref = _GroupRef(group)
        for m in targets:
            m._cp_ref = ref
        return self

