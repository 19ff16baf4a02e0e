"""`cs336-bench`: benchmark sweeps for CS336 assignment 2 that record every measurement to JSONL.

Subcommands live one per module (attention, model, flash, leaderboard, autotune, report); the shared
timing and recording code is in `record`. Entry point: `cs336_systems.bench.cli:main`.
"""
