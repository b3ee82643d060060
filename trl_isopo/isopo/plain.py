"""A process-wide switch that makes ISOPO's backward functions behave like ordinary autograd.

Used for the KL-to-reference term (`beta > 0`): its gradient is an ordinary gradient, not re-weighted by ISOPO's
coefficients, so the trainer back-propagates it in a separate `torch.autograd.grad` pass over the same forward graph
while this switch is on. Inside that pass

- covered linears (`linear.ISOPOLinearFunction`) return the plain weight gradient G^T X (no statistics, no records,
  no EMA update);
- `other_params.RowScale` and the fused LM-head kernel (`fused_head.RowScaledChunkedLogProb`) do not scale rows by
  the advantages.

A plain global, not thread-local: on accelerators autograd runs backward functions on its own device threads.
"""

from __future__ import annotations

import contextlib

_DEPTH = 0


def plain_backward_active() -> bool:
    """Whether backward functions must produce the ordinary (un-reweighted) gradient."""
    return _DEPTH > 0


@contextlib.contextmanager
def plain_backward():
    """Within this block, ISOPO's backward functions compute ordinary gradients."""
    global _DEPTH
    _DEPTH += 1
    try:
        yield
    finally:
        _DEPTH -= 1
