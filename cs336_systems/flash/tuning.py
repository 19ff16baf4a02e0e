"""Tile configs as data: which (query tile, key tile, warps, stages) each Triton kernel runs for a call.

Nothing is timed on the default path. `tile_config` answers from
  1. the shipped table (`tuning_table.json`, written by `cs336-bench autotune --write-table` on the GPU
     named in its `measured` header): the entry for (kernel, arch, padded head dim, dtype class, causal,
     length bucket), or the same key's nearest measured bucket;
  2. else `rule_config`: the configs that won the H200 sweeps, by head dim and dtype class.
Then the tiles are shrunk to the padded sequence lengths, so short calls do not run empty tiles. A length
bucket is a power of two (`length_bucket`), so a new sequence length reuses the compiled kernels of its
bucket: only its ragged-tile flags (`even_flags`) can add a compile. Where one config is within 5% of every
bucket's winner (`shared_config`), all the buckets run it, and a new length compiles nothing.

fp32 runs smaller tiles than 16-bit inputs: its operands take twice the registers and shared memory, and
IEEE fp32 dots (`torch.get_float32_matmul_precision() == "highest"`) unroll into FMAs whose compile time
grows with the tile.
"""

from __future__ import annotations

import functools
import json
import pathlib
from dataclasses import dataclass

import torch

KERNELS = ("fwd", "kv", "dq")  # the tiled kernels (forward, dK/dV pass, dQ pass)
TABLE_PATH = pathlib.Path(__file__).with_name("tuning_table.json")
MIN_BUCKET, MAX_BUCKET = 128, 16384
MIN_TILE = 16  # tl.dot's smallest operand


@dataclass(frozen=True, order=True)
class TileConfig:
    q_tile: int
    k_tile: int
    warps: int
    stages: int

    def constexprs(self) -> dict[str, int]:
        """The launch keywords of this config (tile constexprs and Triton's compile options)."""
        return dict(Q_TILE_SIZE=self.q_tile, K_TILE_SIZE=self.k_tile, num_warps=self.warps, num_stages=self.stages)


INTERPRETER_CONFIG = TileConfig(16, 16, 1, 1)  # the interpreter's cost grows with the tile; any tile is exact
FIXED_CONFIG = TileConfig(64, 64, 4, 3)  # a plain first kernel: the ablation's steps before tuned tiles

# The rule, per (dtype class, padded head dim): the H200 sweeps' winners for 16-bit inputs (d <= 64: the first
# of each autotune list; d 128: 8 warps; d 256: the tiles that fit shared memory), smaller tiles for fp32 and
# smaller still for IEEE fp32.
_RULE = {
    ("16bit", 64): {"fwd": TileConfig(128, 128, 4, 3), "kv": TileConfig(32, 128, 4, 3), "dq": TileConfig(128, 64, 4, 3)},
    ("16bit", 128): {"fwd": TileConfig(128, 64, 8, 3), "kv": TileConfig(64, 128, 8, 3), "dq": TileConfig(128, 64, 8, 3)},
    ("16bit", 256): {"fwd": TileConfig(64, 64, 8, 2), "kv": TileConfig(32, 64, 8, 2), "dq": TileConfig(64, 32, 8, 2)},
    ("fp32", 64): {"fwd": TileConfig(64, 64, 4, 2), "kv": TileConfig(32, 64, 4, 2), "dq": TileConfig(64, 32, 4, 2)},
    ("fp32", 128): {"fwd": TileConfig(64, 32, 4, 2), "kv": TileConfig(32, 32, 4, 2), "dq": TileConfig(64, 32, 4, 2)},
    ("fp32", 256): {"fwd": TileConfig(32, 32, 4, 1), "kv": TileConfig(16, 32, 4, 1), "dq": TileConfig(32, 16, 4, 1)},
    # IEEE fp32 dots unroll into FMAs: 32 × 32 tiles compile in a fraction of the time of 64 × 64 ones, and 8 warps
    # (fewer FMAs unrolled per thread) in half the time of 4
    ("ieee", 64): {"fwd": TileConfig(32, 32, 8, 1), "kv": TileConfig(32, 32, 8, 1), "dq": TileConfig(32, 32, 8, 1)},
    ("ieee", 128): {"fwd": TileConfig(32, 32, 8, 1), "kv": TileConfig(32, 32, 8, 1), "dq": TileConfig(32, 32, 8, 1)},
    ("ieee", 256): {"fwd": TileConfig(16, 32, 8, 1), "kv": TileConfig(16, 32, 8, 1), "dq": TileConfig(32, 16, 8, 1)},
}


def padded_dim(n: int) -> int:
    """A length as the kernels tile it: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(MIN_TILE, 1 << (n - 1).bit_length())  # plain ints: triton.next_power_of_2 costs µs per call


def length_bucket(n_q: int, n_k: int) -> int:
    """The table's length key: the longer length's power of two, within [MIN_BUCKET, MAX_BUCKET]."""
    return min(MAX_BUCKET, max(MIN_BUCKET, padded_dim(max(n_q, n_k))))


def dtype_class(dtype: torch.dtype, precision: str) -> str:
    """"16bit" (bf16, fp16: the same tensor-core tiles), "fp32" (TF32 dots) or "ieee" (IEEE fp32 dots)."""
    if dtype in (torch.bfloat16, torch.float16):
        return "16bit"
    return "ieee" if precision == "ieee" else "fp32"


def rule_config(kernel: str, d_tile: int, dclass: str) -> TileConfig:
    """The config without a table entry."""
    return _RULE[(dclass, max(64, min(256, d_tile)))][kernel]


def fit_to_lengths(config: TileConfig, n_q: int, n_k: int) -> TileConfig:
    """Tiles no longer than the padded lengths they tile."""
    q_tile = min(config.q_tile, padded_dim(n_q))
    k_tile = min(config.k_tile, padded_dim(n_k))
    return TileConfig(q_tile, k_tile, config.warps, config.stages)


@dataclass(frozen=True)
class TableKey:
    kernel: str
    arch: str       # "sm90", from the device's compute capability
    d_tile: int
    dclass: str
    causal: bool
    bucket: int


def arch_name(capability: tuple[int, int]) -> str:
    return f"sm{capability[0]}{capability[1]}"


# A config within this factor of each bucket's winner serves all of a key's buckets: a new length in another
# bucket then compiles nothing (~1 s a kernel), for at most this much of one kernel's time
SHARED_TOLERANCE = 1.05


def shared_config(tried: dict[int, dict[TileConfig, float]]) -> TileConfig | None:
    """Of the configs timed in every bucket (bucket -> config -> ms), the one whose worst ratio to a bucket's best
    is least, if that ratio is within SHARED_TOLERANCE; else None (each bucket keeps its winner)."""
    if len(tried) < 2:
        return None
    common = set.intersection(*(set(times) for times in tried.values()))
    if not common:
        return None

    def worst(config: TileConfig) -> float:
        return max(times[config] / min(times.values()) for times in tried.values())

    best = min(sorted(common), key=worst)
    return best if worst(best) <= SHARED_TOLERANCE else None


@functools.cache
def load_table(path: pathlib.Path = TABLE_PATH) -> dict[TableKey, TileConfig]:
    """The shipped table (empty when there is no table file): per key, each bucket's winner, or the `shared_config`
    of the key's buckets where the entries list every config's time (`tried`: [q, k, warps, stages, ms] each)."""
    if not path.exists():
        return {}
    table: dict[TableKey, TileConfig] = {}
    tried: dict[tuple, dict[int, dict[TileConfig, float]]] = {}
    for e in json.loads(path.read_text())["entries"]:
        key = TableKey(e["kernel"], e["arch"], e["d"], e["dtype"], e["causal"], e["bucket"])
        table[key] = TileConfig(*e["config"])
        if e.get("tried"):
            group = tried.setdefault((key.kernel, key.arch, key.d_tile, key.dclass, key.causal), {})
            group[key.bucket] = {TileConfig(*t[:4]): t[4] for t in e["tried"]}
    for group, per_bucket in tried.items():
        shared = shared_config(per_bucket)
        if shared is not None:
            table.update({TableKey(*group, bucket): shared for bucket in per_bucket})
    return table


def table_config(table: dict[TableKey, TileConfig], key: TableKey) -> TileConfig | None:
    """The entry for key, or the entry of the nearest measured bucket (ties: the shorter) of the same key."""
    if key in table:
        return table[key]
    near = [k for k in table if (k.kernel, k.arch, k.d_tile, k.dclass, k.causal)
            == (key.kernel, key.arch, key.d_tile, key.dclass, key.causal)]
    if not near:
        return None
    best = min(near, key=lambda k: (abs(k.bucket.bit_length() - key.bucket.bit_length()), k.bucket))
    return table[best]


def tile_config(kernel: str, *, arch: str | None, d_tile: int, dtype: torch.dtype, precision: str, causal: bool,
                n_q: int, n_k: int, table: dict[TableKey, TileConfig] | None = None) -> TileConfig:
    """The config `kernel` runs for a call (see the module); `arch` None: the interpreter."""
    if arch is None:
        return INTERPRETER_CONFIG
    dclass = dtype_class(dtype, precision)
    key = TableKey(kernel, arch, d_tile, dclass, causal, length_bucket(n_q, n_k))
    found = table_config(load_table() if table is None else table, key)
    return fit_to_lengths(found or rule_config(kernel, d_tile, dclass), n_q, n_k)


def even_flags(config: TileConfig, n_q: int, n_k: int, d: int, d_tile: int, tma: bool) -> dict[str, bool]:
    """Bounds checks only where a length does not divide its tile (flash-attention's EVEN_M/EVEN_N). With TMA the
    copy engine bounds the tiles, and the checks left (the rows of L and delta) cost nothing measurable: they stay
    on, so that ragged and even lengths share one compiled kernel."""
    return dict(CHECK_Q=tma or n_q % config.q_tile != 0, CHECK_K=tma or n_k % config.k_tile != 0, CHECK_D=d != d_tile)
