"""Transports of the trainer: `threads` (one process, a thread per worker) and `distributed` (a process per device)."""
