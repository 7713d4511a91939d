"""One module per pipeline stage: `add_arguments(parser)` and `run(loaded, args) -> int`.

Stage modules stay thin and import the heavy machinery (torch, transformers) inside `run`, so that
`python -m dflash --help` is instant.
"""
