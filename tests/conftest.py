"""Without a GPU the Triton kernels run through Triton's interpreter: the variable must be set
before `cs336_systems.flash_triton` defines them, so it is set here, before any test imports."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
