"""CS336 assignment 1 building blocks: Transformer LM, loss, and optimizer."""

from cs336_basics.model import (
    BATCH_SIZE,
    MODEL_CONFIGS,
    VOCAB_SIZE,
    BasicsTransformerLM,
    ModelConfig,
    causal_mask,
    scaled_dot_product_attention,
    softmax,
)
from cs336_basics.nn_utils import clip_gradient, cross_entropy
from cs336_basics.optimizer import AdamW

__all__ = [
    "BATCH_SIZE",
    "MODEL_CONFIGS",
    "VOCAB_SIZE",
    "AdamW",
    "BasicsTransformerLM",
    "ModelConfig",
    "causal_mask",
    "clip_gradient",
    "cross_entropy",
    "scaled_dot_product_attention",
    "softmax",
]
