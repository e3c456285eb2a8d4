"""Numerical constants of the TSSA-family operators, in one place.

Every implementation reads them from here: the PyTorch paths (:mod:`.tssa.parallel`,
:mod:`.causal_tssa.parallel`), the references (:mod:`.reference`), DMSA, and the fused kernels
(compiled into the C++ kernels as ``-D`` flags by :mod:`._kernels.build`; a device backend takes
them from here too). The values are the official ToST code's; all are representable in float16
(``NORM_EPS ** 2`` is used in float32 statistics only).
"""

NORM_EPS = 1e-12
"""``F.normalize``'s eps on the l2 norm of each feature over the tokens (ToST Eq. (32)); the
kernels clamp the squared norm at ``NORM_EPS ** 2``."""

PI_EPS = 1e-8
"""Added to the membership mass ``sum_n Pi_n`` before dividing (ToST Eq. (11), (28))."""

RATIO_EPS = 1e-12
"""Clamp on the causal prefix energy ``sum_{s<=t} w_s^2`` (ToST Eq. (35), official code)."""

SAFE_MAX = 2.0 ** 32
"""Largest |w| left unscaled (:mod:`.scaling`): sums of up to 2^60 squares of it stay below
float32's range (2^128). The fused CPU kernels take inputs whose every feature's sum of squares is
at most ``SAFE_MAX ** 2`` (a larger |w| always shows there) and signal the others."""
