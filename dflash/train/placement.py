"""Where each worker runs: device strings from config, validated against the machine."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash.config_model import TrainSection
from dflash.device_names import device_name, same_devices
from dflash.errors import UserError


def parse_device(spec: str | int) -> torch.device:
    """'cpu', 'cuda', 'cuda:3' or '3' -> torch.device."""
    s = str(spec).strip()
    if s.isdigit():
        s = f"cuda:{s}"
    try:
        dev = torch.device(s)
    except RuntimeError:
        raise UserError(f"train placement: '{spec}' is not a device (use cpu, cuda:N or N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"train placement: '{spec}' asks for a GPU but CUDA is not available here")
        index = dev.index or 0
        if index >= torch.cuda.device_count():
            raise UserError(f"train placement: '{spec}' but only {torch.cuda.device_count()} GPU(s) are visible")
        dev = torch.device("cuda", index)
    elif dev.type != "cpu":
        raise UserError(f"train placement: device type '{dev.type}' is not supported (cpu or cuda)")
    return dev


@dataclass(frozen=True)
class Placement:
    targets: tuple[torch.device, ...]
    drafters: tuple[torch.device, ...]
    runtime: str  # threads | distributed
    # distributed, train.targets == train.drafters: rank r runs a target and drafter replica r on drafters[r] (no
    # feature transport; replicas in one DDP group)
    colocated: bool = False
    nnodes: int = 1   # distributed: train.rendezvous.nnodes
    # train.target_split > 1: each target worker's devices, its entry of `targets` first (empty: one device each)
    target_groups: tuple[tuple[torch.device, ...], ...] = ()

    def group(self, device: torch.device) -> tuple[torch.device, ...]:
        """The devices of the target worker on `device` (its layers split over them; itself alone unless split)."""
        return next((g for g in self.target_groups if g[0] == device), (device,))

    @property
    def devices(self) -> tuple[torch.device, ...]:
        seen = []
        for d in self.targets + self.drafters:
            if d not in seen:
                seen.append(d)
        return tuple(seen)

    @property
    def gpus(self) -> tuple[torch.device, ...]:
        return tuple(d for d in self.devices if d.type == "cuda")

    @property
    def gpu_count(self) -> int:
        """GPUs the run uses: distributed, one per GPU rank on every node (the nodes list the same local cuda:N);
        threads, the distinct GPUs listed."""
        if self.runtime == "distributed":
            return sum(d.type == "cuda" for d in self.ranks)
        return len(self.gpus)

    def compiled_workers(self, compile_target: bool) -> int:
        """Workers one process compiles for, each on its device (compile_guard.recompile_limit): the threads runtime,
        every drafter replica and, with train.compile_target, every target; the distributed one, a rank's drafter
        replica or target, and its own target where co-located."""
        if self.runtime == "distributed":
            return 1 + (self.colocated and compile_target)
        return len(self.drafters) + (len(self.targets) if compile_target else 0)

    # ---- the distributed runtime's ranks: the one place that maps rank -> worker -> node -> device ----
    @property
    def target_ranks(self) -> int:
        """Ranks 0..T-1 run a target only, ranks T..T+D-1 drafter replicas 0..D-1 (co-located: T = 0, each
        drafter rank runs its own target)."""
        return 0 if self.colocated else len(self.targets)

    @property
    def ranks(self) -> tuple[torch.device, ...]:
        """Rank r's device: the entries of train.targets then train.drafters (co-located: train.drafters)."""
        return self.drafters if self.colocated else self.targets + self.drafters

    @property
    def per_node(self) -> int:
        """Local ranks per node (torchrun's --nproc-per-node). Torch's elastic agent numbers every node's local ranks
        consecutively: rank r = node rank x per_node + local rank, so rank r runs on node r // per_node."""
        return len(self.ranks) // self.nnodes

    def node_ranks(self, node: int) -> range:
        return range(node * self.per_node, (node + 1) * self.per_node)

    def worker(self, rank: int) -> str:
        T = self.target_ranks
        return (f"drafter-{rank} + target" if self.colocated else
                f"target-{rank}" if rank < T else f"drafter-{rank - T}")

    def role(self, rank: int) -> str:
        return f"{self.worker(rank)} ({self.ranks[rank]})"

    def device_name(self, rank: int) -> str:
        """Rank r's device as summaries and the report name it: `cuda:0` on one node, `node1/cuda:0` on several."""
        return device_name(self.ranks[rank], rank // self.per_node, self.nnodes)


def resolve(train_cfg: TrainSection) -> Placement:
    # every node checks every entry: the c10d rendezvous decides which host becomes node n, so any node may run any
    # node's ranks (the nodes are alike: each lists its own local cuda:N)
    listed, n = tuple(parse_device(d) for d in train_cfg.targets), train_cfg.target_split
    groups = tuple(listed[i:i + n] for i in range(0, len(listed), n)) if n > 1 else ()
    targets = tuple(g[0] for g in groups) or listed
    drafters = tuple(parse_device(d) for d in train_cfg.drafters)
    runtime, nnodes = train_cfg.runtime, train_cfg.rendezvous.nnodes
    workers = targets + drafters
    if runtime == "auto":   # a process per GPU where every worker has its own GPU (several nodes: always)
        own_gpu = all(d.type == "cuda" for d in workers) and 1 < len(set(workers)) == len(workers)
        runtime = "distributed" if nnodes > 1 or own_gpu else "threads"
    if runtime != "distributed":
        if nnodes > 1:
            raise UserError(f"train.runtime is {runtime} (one process on one node) but train.rendezvous.nnodes is "
                            f"{nnodes}: several nodes need train.runtime: distributed")
        return Placement(targets, drafters, runtime, target_groups=groups)
    colocated = same_devices(train_cfg.targets, train_cfg.drafters)
    if colocated and groups:
        raise UserError(f"train.target_split {n} with the co-located distributed layout (train.targets equal to "
                        "train.drafters): a rank runs one device's target and replica; list the target groups' "
                        "devices apart from train.drafters, or use train.runtime: threads")
    p = Placement(targets, drafters, runtime, colocated, nnodes, groups)
    lists = "train.drafters (co-located)" if p.colocated else "train.targets + train.drafters"
    if len({d.type for d in p.ranks}) > 1:
        cpu = ", ".join(f"rank {r} = {p.worker(r)}" for r, d in enumerate(p.ranks) if d.type == "cpu")
        raise UserError(f"train.runtime is distributed but the ranks mix CPU and GPU devices ({cpu} on the CPU): "
                        "every rank needs a GPU (nccl) or every rank the CPU (gloo)"
                        + ("; use train.runtime: threads to mix them" if nnodes == 1 else ""))
    if len(p.ranks) % nnodes:
        raise UserError(f"train.rendezvous.nnodes is {nnodes} but the {len(p.ranks)} ranks ({lists}) do not split "
                        f"evenly over the nodes: every node runs the same number of local ranks")
    for node in range(nnodes):
        ranks = p.node_ranks(node)
        devs = [p.ranks[r] for r in ranks]
        shared = [d for d in dict.fromkeys(devs) if d.type == "cuda" and devs.count(d) > 1]
        if not shared:
            continue
        held = "; ".join(f"{d} holds " + ", ".join(f"rank {r} = {p.worker(r)}" for r in ranks if p.ranks[r] == d)
                         for d in shared)
        if nnodes == 1:
            raise UserError(f"train.runtime is distributed but a GPU holds several ranks ({held}): NCCL takes one "
                            "rank per GPU; use train.runtime: threads for shared GPUs, or list the same GPUs, once "
                            "each, in train.targets and train.drafters (each rank then runs a target and a drafter "
                            "replica)")
        first, last = ranks[0], ranks[-1]
        raise UserError(f"train.rendezvous.nnodes is {nnodes}: node {node} runs ranks {first}-{last} (entries "
                        f"{first}-{last} of {lists}, {p.per_node} per node) but a GPU there holds several ranks "
                        f"({held}): NCCL takes one rank per GPU; list each node's local GPUs once each")
    return p


def attention_backend(train_cfg: TrainSection, drafter_devices) -> str:
    """auto: flex where every drafter is on a GPU, sdpa otherwise (flex has no CPU backward in torch >= 2.11)."""
    if train_cfg.attention != "auto":
        return train_cfg.attention
    return "flex" if all(d.type == "cuda" for d in drafter_devices) else "sdpa"


def autocast_dtype(train_cfg: TrainSection, device: torch.device):
    """bf16 autocast on GPU, none (float32) on CPU, unless the config says otherwise."""
    if train_cfg.dtype == "float32" or (train_cfg.dtype == "auto" and device.type != "cuda"):
        return None
    return torch.bfloat16
