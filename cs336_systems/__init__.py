"""cs336-systems: FlashAttention-2 (PyTorch and Triton), data-parallel training, benchmarks.

`from cs336_systems import flash_attention` gives the SDPA-style attention op (`flash_attention_varlen`: its
packed-sequence form). The names load on
first use, so importing the package (e.g. for `cs336-bench --help`) imports neither Triton nor the
kernels, and TRITON_INTERPRET can still be set before they are defined.
"""

from __future__ import annotations

_LAZY = {
    "flash_attention": "cs336_systems.flash_triton",
    "flash_attention_varlen": "cs336_systems.flash_triton",
    "FlashAttention2Triton": "cs336_systems.flash_triton",
    "FlashAttention2Pytorch": "cs336_systems.flash_pytorch",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'cs336_systems' has no attribute {name!r}")


__all__ = list(_LAZY)
