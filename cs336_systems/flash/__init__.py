"""FlashAttention-2 for PyTorch in Triton (and Gluon on Hopper), split by role:

  triton_kernels   Triton device code: tile helpers, inner loops, kernels (no host code)
  gluon/           Gluon (sm_90) kernels, a file each (the forward, the dK/dV passes, the single-pass backward),
                   their shared device code, configs, tile order and launches (`gluon/__init__` has the layout)
  tuning           tile configs as data: the shipped table and the rule behind it (nothing timed by default)
  autotune         opt-in autotuning: the config lists Triton's autotuner times (`cs336-bench autotune`)
  chooser          which design runs a call: pure functions of its metadata, with the routing table
  launch           per-signature plans and launches (C launches after the first), the CPU fallback
  background       compiles ahead of a kernel's first launch, in threads; a launch waits for its own
  c_launch         a compiled kernel's direct C launch
  ops              the torch.library ops, `FlashAttention2Triton`, `flash_attention`

The public names are in `cs336_systems` (`flash_attention`) and `cs336_systems.flash_triton`. This package
imports nothing by itself, so that TRITON_INTERPRET can be set before the kernels are defined.
"""
