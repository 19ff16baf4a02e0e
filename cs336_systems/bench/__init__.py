"""`cs336-bench`: benchmark sweeps for CS336 assignment 2 that record every measurement to JSONL.

One module per problem (attention, model, flash, leaderboard, overhead, autotune, resources), each
with its options, its sweep and its renderer; `cli` registers them, `impls` maps implementation names
to callables, `record` writes the rows, `timing` measures, `report` holds the rendering toolkit and
`options` the shared argument handling. Entry point: `cs336_systems.bench.cli:main`.
"""
