"""A device's name in summaries and the report (torch-free: the report reads it too).

Every node numbers its own GPUs from cuda:0, so on several nodes a GPU is named by its node as well: `node1/cuda:0`.
On one node the name stays the plain device (`cuda:0`, `cpu`), so single-node summaries and history are unchanged.
Which node a rank runs on is the placement's (dflash/train/placement.py: rank r on node r // per_node).
"""
from __future__ import annotations


def normalize(spec) -> str:
    """A config device entry as torch prints it: '3' -> 'cuda:3', 'cuda' -> 'cuda:0'; others unchanged."""
    s = str(spec).strip()
    return f"cuda:{s}" if s.isdigit() else ("cuda:0" if s == "cuda" else s)


def same_devices(targets, drafters) -> bool:
    """The same devices, in order, in train.targets and train.drafters (co-located: each rank a target + a replica)."""
    return [normalize(d) for d in targets] == [normalize(d) for d in drafters]


def device_name(device, node: int = 0, nnodes: int = 1) -> str:
    """'cuda:0' on one node, 'node1/cuda:0' for cuda:0 of node 1 when there are several."""
    s = normalize(device)
    return s if nnodes <= 1 else f"node{node}/{s}"


def rank_names(devices, nnodes: int = 1) -> list[str]:
    """Each rank's device name, rank r on node r // (ranks per node), torchrun's numbering."""
    per_node = max(len(devices) // max(nnodes, 1), 1)
    return [device_name(d, r // per_node, nnodes) for r, d in enumerate(devices)]
