"""Triton kernels for dspark, each with a plain PyTorch reference and an ``impl`` dispatcher.

``impl="auto"`` runs Triton on CUDA tensors when triton imports, else the PyTorch path;
``"torch"`` / ``"triton"`` force one (``"triton"`` on CPU tensors needs ``TRITON_INTERPRET=1``
set before this package is imported).
"""

from ._common import triton_available, triton_interpreting
from .cache_attention import cache_attention, cache_attention_reference, folded_mask
from .fused_loss import DraftLoss, RowWeights, fused_draft_loss, materialized_draft_loss
from .rejection import RejectionResult, rejection_verify, rejection_verify_reference
from .sample_step import SampleStep, sample_from_reference, sample_step, sample_step_reference

__all__ = [
    "triton_available",
    "triton_interpreting",
    "DraftLoss",
    "RowWeights",
    "materialized_draft_loss",
    "fused_draft_loss",
    "SampleStep",
    "sample_from_reference",
    "sample_step_reference",
    "sample_step",
    "RejectionResult",
    "rejection_verify_reference",
    "rejection_verify",
    "cache_attention",
    "cache_attention_reference",
    "folded_mask",
]
