"""Opt-in autotuning: the config lists Triton's autotuner times (`KernelOptions(autotune=True)`), and what
`cs336-bench autotune` needs to measure them and write the tuning table. Nothing here runs by default."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from cs336_systems.flash import chooser, triton_kernels as kernels
from cs336_systems.flash.triton_kernels import INTERPRET
from cs336_systems.flash.tuning import padded_dim

# Bounds checks only where a length does not divide its tile (`tuning.even_flags` for a known config).
EVEN_HEURISTICS = {
    "CHECK_Q": lambda a: a["N_QUERIES"] % a["Q_TILE_SIZE"] != 0,
    "CHECK_K": lambda a: a["N_KEYS"] % a["K_TILE_SIZE"] != 0,
    "CHECK_D": lambda a: a["D"] != a["D_TILE"],
}


def make_configs(shapes, *, a: str = "Q_TILE_SIZE", b: str = "K_TILE_SIZE") -> list[triton.Config]:
    """Autotune configs from (tile_a, tile_b, warps, stages); one pinned config in the interpreter."""
    if INTERPRET:
        shapes = [(16, 16, 1, 1)]
    return [triton.Config({a: ta, b: tb}, num_warps=w, num_stages=s) for ta, tb, w, s in shapes]


# (Q_TILE_SIZE, K_TILE_SIZE, warps, stages): 8-warp ones serve d = 128; LARGE_D ones only d > 128 (and only they do)
FWD_CONFIGS = make_configs(
    [(128, 128, 4, 3), (128, 64, 4, 3), (64, 128, 4, 2), (128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 2)])
KV_CONFIGS = make_configs(  # keys per program are the second number
    [(32, 128, 4, 3), (64, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3), (64, 64, 4, 4)])
DQ_CONFIGS = make_configs(
    [(128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3), (128, 32, 4, 3)])
# (the interpreter runs one pinned config for every head dim)
LARGE_D_FWD = [] if INTERPRET else make_configs([(64, 64, 8, 2), (64, 32, 4, 2)])
LARGE_D_KV = [] if INTERPRET else make_configs([(32, 64, 8, 2), (16, 64, 4, 2)])
LARGE_D_DQ = [] if INTERPRET else make_configs([(64, 32, 8, 2), (64, 64, 8, 2)])
_LARGE_D = {id(c) for c in (*LARGE_D_FWD, *LARGE_D_KV, *LARGE_D_DQ)}
_AUTOTUNE_KEY = ["N_QUERIES", "N_KEYS", "D", "KV_GROUP", "is_causal", "USE_TMA", "PRECISION", "HAS_WINDOW"]


def _prune(configs, named_args, **kwargs):
    """Keep the configs for this head-dim class whose tiles fit the padded problem (short sequences
    stay cheap to tune)."""
    args = {**named_args, **kwargs}
    large_d = args["D_TILE"] > 128
    configs = [c for c in configs if (id(c) in _LARGE_D) == large_d] or configs
    n_q, n_k = padded_dim(args["N_QUERIES"]), padded_dim(args["N_KEYS"])
    kept = [c for c in configs if c.kwargs["Q_TILE_SIZE"] <= n_q and c.kwargs["K_TILE_SIZE"] <= n_k]
    return kept or [min(configs, key=lambda c: c.kwargs["Q_TILE_SIZE"] * c.kwargs["K_TILE_SIZE"])]


def _autotuned(fn, configs, extra_key=(), reset_to_zero=None):
    return triton.autotune(
        configs=configs, key=[*_AUTOTUNE_KEY, *extra_key], prune_configs_by={"early_config_prune": _prune},
        reset_to_zero=reset_to_zero,
    )(triton.heuristics(EVEN_HEURISTICS)(fn))


flash_fwd_autotuned = _autotuned(kernels.flash_fwd_kernel, FWD_CONFIGS + LARGE_D_FWD, ["SPLIT"])
# the single pass accumulates into dQacc: each config the autotuner times starts from zeros
flash_bwd_kv_autotuned = _autotuned(kernels.flash_bwd_kv_kernel, KV_CONFIGS + LARGE_D_KV,
                                    ["DQ_ATOMIC", "DP_FIRST", "SPLIT"], ["dQacc_ptr"])
flash_bwd_dq_autotuned = _autotuned(kernels.flash_bwd_dq_kernel, DQ_CONFIGS + LARGE_D_DQ,
                                    ["DP_FIRST", "FUSED_PREP", "COPY_DO", "SPLIT"])


@dataclass(frozen=True)
class KernelSpec:
    """One tunable kernel, as the benchmarks (autotune, resources) see it.

    `example_launch(dtype, heads, seq, d, causal)` gives the positional arguments (MockTensors for
    tensors, ints/floats otherwise) and constexpr keywords of a launch on contiguous
    (1, heads, seq, d) inputs, without the tile constexprs a config sets.
    """

    name: str
    table_name: str  # its name in the tuning table ("fwd", "kv", "dq")
    jit: triton.JITFunction
    autotuned: triton.runtime.Autotuner
    wide_tiles: tuple[tuple[int, int], ...]  # (Q_TILE_SIZE, K_TILE_SIZE) pairs for a wide config search
    constexprs: tuple[tuple[str, object], ...] = ()  # what this entry fixes beyond the shape's constexprs

    @property
    def configs(self) -> list[triton.Config]:
        return self.autotuned.configs

    def example_launch(self, dtype: torch.dtype, heads: int, seq: int, d: int, causal: bool):
        from triton.runtime.jit import MockTensor

        args = []
        for param in self.jit.params:
            name = param.name
            if param.is_constexpr:
                break
            if name.endswith("_ptr"):
                fp32 = name in ("L_ptr", "Delta_ptr", "dQacc_ptr")
                args.append(MockTensor(torch.float32 if fp32 else dtype))
            elif name.startswith("stride_"):  # a (batch, head, seq, d) stride tuple
                args.append((heads * seq * d, seq * d, d, 1))
            elif name == "N_HEADS":
                args.append(heads)
            elif name == "KV_GROUP":
                args.append(1)
            elif name in ("N_QUERIES", "N_KEYS"):
                args.append(seq)
            elif name == "scale":
                args.append(d ** -0.5)
            elif name in ("CHUNK", "WINDOW_LEFT", "WINDOW_RIGHT"):  # unused without SPLIT, HAS_WINDOW
                args.append(0)
            else:
                raise ValueError(f"no example value for argument {name!r} of {self.name}")
        tma = not INTERPRET and torch.cuda.is_available() and chooser.tma_default(torch.cuda.current_device())
        constexprs = dict(D=d, D_TILE=padded_dim(d), is_causal=causal, SKIP_MASKED_TILES=True, USE_TMA=tma,
                          PRECISION=chooser.precision(dtype), SPLIT=False, HAS_WINDOW=False, **dict(self.constexprs))
        return args, constexprs


_WIDE_Q_K = ((64, 32), (64, 64), (64, 128), (128, 64), (128, 128))
_WIDE_KV = ((32, 64), (32, 128), (64, 64), (64, 128), (128, 64), (128, 128))
KERNELS: dict[str, KernelSpec] = {
    "flash_fwd": KernelSpec("flash_fwd", "fwd", kernels.flash_fwd_kernel, flash_fwd_autotuned, _WIDE_Q_K),
    "flash_bwd_kv_atomic": KernelSpec(
        "flash_bwd_kv_atomic", "kv", kernels.flash_bwd_kv_kernel, flash_bwd_kv_autotuned, _WIDE_KV,
        (("DQ_ATOMIC", True), ("DP_FIRST", True))),
    "flash_bwd_kv": KernelSpec(
        "flash_bwd_kv", "kv", kernels.flash_bwd_kv_kernel, flash_bwd_kv_autotuned, _WIDE_KV,
        (("DQ_ATOMIC", False), ("DP_FIRST", True))),
    "flash_bwd_dq": KernelSpec(
        "flash_bwd_dq", "dq", kernels.flash_bwd_dq_kernel, flash_bwd_dq_autotuned,
        ((64, 32), (64, 64), (128, 32), (128, 64), (128, 128)),
        (("DP_FIRST", True), ("FUSED_PREP", True), ("COPY_DO", False))),
}
AUTOTUNED_KERNELS = {
    "flash_fwd": flash_fwd_autotuned, "flash_bwd_kv": flash_bwd_kv_autotuned, "flash_bwd_dq": flash_bwd_dq_autotuned,
}
