"""FedACT-AdamW, the client optimizer of FedACT (seed: Algorithm 1, lines 4-18).

- fedact_adamw.py: :class:`FedACTAdamW`, the optimizer (maths, arguments, state, rounds);
- layout.py: the flat buffers its state and scratch live in;
- kernels.py: the functional core, one step over those buffers (eager, fused, compiled);
- topk.py: the exact top-k selection (:func:`top_k_indicator_`).

FedAdamW (``trust_signal="none"``) and FedACT-Local (``trust_signal="local"``) are the same
class with another trust signal.
"""

from fedact_app.optim.fedact_adamw import TRUST_SCOPES, TRUST_SIGNALS, FedACTAdamW
from fedact_app.optim.topk import top_k_indicator_

__all__ = ["FedACTAdamW", "TRUST_SCOPES", "TRUST_SIGNALS", "top_k_indicator_"]
