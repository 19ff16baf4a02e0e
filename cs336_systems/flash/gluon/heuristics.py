"""The order the Gluon kernels start their programs in (`common.grouped_program`'s (HEAD_GROUP, TAIL)) and the
persistent forward's grid: small functions of a call's sizes and the device's L2 and SM count (the package docstring
has the rules)."""

from __future__ import annotations

import functools

import torch

from cs336_systems.flash.chooser import sm_count

# The share of the L2 that the rows a group of heads streams may fill (`grouped_program`, `head_groups`)
L2_SHARE = 0.5
# The last group's work per SM, in its longest programs (`head_groups`)
TAIL_WORK = 1.5
# Resident programs of the persistent forward per SM (its one consumer warpgroup's register ceiling,
# ONE_WARPGROUP_MAXNREG, leaves room for two)
PERSISTENT_PROGRAMS_PER_SM = 2


def head_groups(heads: int, bytes_per_head: int, work_per_head: int, longest: int,
                device_index: int | None) -> tuple[int, int]:
    """(HEAD_GROUP, TAIL) of `grouped_program` for a grid of `heads` along axis 0 whose programs stream
    `bytes_per_head` each and take `work_per_head` steps per head, `longest` in the longest program: groups of as
    many heads as fit in L2_SHARE of the L2 (at least one), and a last group large enough for TAIL_WORK longest
    programs of work per SM. One group of all heads without a device (a CPU compile: both are run-time
    arguments)."""
    if device_index is None:
        return heads, heads
    props = torch.cuda.get_device_properties(device_index)
    group = max(1, min(heads, int(L2_SHARE * props.L2_cache_size) // max(bytes_per_head, 1)))
    return group, tail_group(heads, group, work_per_head, longest, props.multi_processor_count)


def tail_group(lines: int, group: int, work_per_line: int, longest: int, sms: int) -> int:
    """TAIL of `grouped_program` for groups of `group` lines whose programs take `work_per_line` steps a line,
    `longest` in the longest program: the smallest last group (at least `group` lines, whole groups before it) that
    holds TAIL_WORK longest programs of work per SM, so that the longest programs do not run alone at the end; every
    line where no smaller one does."""
    least = -(-int(TAIL_WORK * longest * sms) // max(work_per_line, 1))
    return next((t for t in range(max(group, least), lines) if (lines - t) % group == 0), lines)


def persistent_programs(items: int, device_index: int | None) -> int:
    """The persistent forward's grid for `items` work items: PERSISTENT_PROGRAMS_PER_SM programs per SM, at most one
    per item (one per item without a device, a CPU compile); at least one."""
    if device_index is None:
        return max(items, 1)
    return max(min(items, PERSISTENT_PROGRAMS_PER_SM * sm_count(device_index)), 1)


def wave_size(lines: int, tiles: int, sms: int) -> int:
    """The lines of `tiles` programs each that fill `sms` SMs once (at least one)."""
    return max(1, min(lines, sms // max(tiles, 1)))


def wave_tail_groups(lines: int, steps: list[int], device_index: int | None) -> tuple[int, int]:
    """(HEAD_GROUP, TAIL) of `grouped_program` for a grid of `lines` along axis 0 whose programs take `steps` a line
    (a program each): groups of `wave_size` lines and their `tail_group`. One group of all lines without a device."""
    if device_index is None:
        return lines, lines
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    group = wave_size(lines, len(steps), sms)
    return group, tail_group(lines, group, sum(steps), max(steps, default=0), sms)


def wave_groups(lines: int, tiles: int, device_index: int | None) -> tuple[int, int]:
    """(HEAD_GROUP, TAIL) of `grouped_program` for a grid of `lines` along axis 0 and `tiles` programs a line that
    starts a wave at a time: groups of as many lines as their programs fill the SMs once (at least one), the
    remainder in the last group. The single pass's order: the L2 rule (`head_groups`) gave a grouped-query call
    small groups and a last group of most of its lines, which ran the kernel up to 1.5x slower on an H100
    (runs/ab/single_pass_wave_groups_f032026.jsonl). One group of all lines without a device (a CPU compile)."""
    if device_index is None:
        return lines, lines
    group = wave_size(lines, tiles, torch.cuda.get_device_properties(device_index).multi_processor_count)
    return group, group + lines % group if lines > group else lines


def kv_head_groups(q4: torch.Tensor, k4: torch.Tensor, is_causal: bool, block_m: int, block_n: int,
                   single_pass: bool) -> tuple[int, int]:
    """(HEAD_GROUP, TAIL) of a dK/dV pass (grid axis 0: batch·kv heads; a program per BLOCK_N keys, a BLOCK_M-query
    tile of each of its kv head's query heads per step): a single pass's `wave_groups`; a two-pass dK/dV pass's
    `wave_tail_groups` where a kv head serves one query head, and `head_groups` over the Q, dO, L and delta rows its
    programs stream where it serves several. On an H100, against the L2 rule, wave groups with the tail took the
    16-head calls' pass 0.78-1.02x (0.78x at 32 x 512 d 64 not causal) but grouped-query 16:4 d 64 causal ones
    1.02-1.05x, whose programs are four heads long (runs/ab/wave_groups_tail_c1f98a0.jsonl)."""
    batch, heads, n_q, d = q4.shape
    return _kv_head_groups(batch, heads, k4.shape[1], n_q, k4.shape[2], d, q4.element_size(), is_causal, block_m,
                           block_n, single_pass, q4.device.index)


def fwd_head_groups(q4: torch.Tensor, k4: torch.Tensor, is_causal: bool, rows: int, block_n: int) -> tuple[int, int]:
    """(HEAD_GROUP, TAIL) of a dense forward (grid axis 0: batch·heads; a program per `rows` queries, a BLOCK_N-key
    tile per step): `wave_tail_groups` (a wave of lines a group: a line's programs run together and share its K and
    V in the L2; past as many heads as SMs the plain order's resident programs each read another head's K and V,
    which the L2 cannot hold for the head's next query tile). Against the L2 rule (`head_groups`) on an H100:
    0.92-1.01x, faster where programs are short (16 x 1024 d 128 causal 0.92x;
    runs/ab/wave_groups_tail_c1f98a0.jsonl)."""
    batch, heads, n_q, _ = q4.shape
    return _fwd_head_groups(batch * heads, n_q, k4.shape[2], is_causal, rows, block_n, q4.device.index)


@functools.cache
def _fwd_head_groups(lines: int, n_q: int, n_k: int, is_causal: bool, rows: int, block_n: int,
                     device_index: int | None) -> tuple[int, int]:
    steps = [-(-min(i + rows, n_k) // block_n) if is_causal else n_k // block_n for i in range(0, n_q, rows)]
    return wave_tail_groups(lines, steps, device_index)


@functools.cache
def _kv_head_groups(batch: int, heads: int, kv_heads: int, n_q: int, n_k: int, d: int, item: int, is_causal: bool,
                    block_m: int, block_n: int, single_pass: bool, device_index: int | None) -> tuple[int, int]:
    lines = batch * kv_heads
    if single_pass:
        return wave_groups(lines, -(-n_k // block_n), device_index)
    steps = [(heads // kv_heads) * (max(n_q - j, 0) if is_causal else n_q) // block_m
             for j in range(0, n_k, block_n)]
    if heads > kv_heads:
        return head_groups(lines, n_q * (heads // kv_heads) * (2 * d * item + 8), sum(steps), max(steps), device_index)
    return wave_tail_groups(lines, steps, device_index)
