"""Data-parallel training on torch.distributed: DDP wrappers, optimizer state sharding, a launcher."""

from cs336_systems.distributed.ddp import (
    DataParallelBase,
    DDPBucketed,
    DDPIndividualParameters,
    FlatDDP,
    NaiveDDP,
    assign_buckets,
)
from cs336_systems.distributed.sharded_optimizer import ShardedOptimizer

__all__ = [
    "DataParallelBase",
    "DDPBucketed",
    "DDPIndividualParameters",
    "FlatDDP",
    "NaiveDDP",
    "ShardedOptimizer",
    "assign_buckets",
]
