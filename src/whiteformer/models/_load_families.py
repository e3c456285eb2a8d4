"""Imports every model family so that their ``@register_model`` entry points are registered.
Each family adds one import line here."""
from . import vision  # noqa: F401,E402  (ToST / DMST / ECA / XCiT / ViT-CAB shell: class + entry points)
from . import crate  # noqa: F401,E402  (CRATE: MSSA + ISTA)
from . import deit  # noqa: F401,E402  (timm-compatible ViT / DeiT)
from . import lm  # noqa: F401,E402  (causal ToST / GPT language models)
from . import lra  # noqa: F401,E402  (Long-Range-Arena sequence classifiers, ToST Table 7)
from . import decoder  # noqa: F401,E402  (Llama-style decoder: softmax, causal TSSA or hybrid)
from . import hybrid_lm  # noqa: F401,E402  (causal ToST in the GPT shell, hybrid: GPT-2 linearized)
