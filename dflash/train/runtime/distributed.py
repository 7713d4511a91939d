"""The `distributed` transport: one process per device, started by torch's elastic launcher; each rank runs the
lifecycle of dflash/train/run.py over `Ranks`.

Ranks 0..T-1 are target workers, ranks T..T+D-1 drafter replicas (the placement lists, in order; rank r runs on
node r // nproc-per-node: dflash/train/placement.py maps rank -> worker -> node -> device). Micro-batch i
is computed by target rank i % T and sent point-to-point (NCCL on GPU, gloo on CPU) to drafter rank T + i % D, with
at most `queue_size` sends in flight per target (back-pressure). Drafter replicas are one DistributedDataParallel
group: bucketed gradient all-reduces overlap the backward. Drafter rank 0 writes metrics, checkpoints and the
summary (the lifecycle's writer).
Co-located (train.targets == train.drafters): D ranks, rank r runs a target and drafter replica r on drafters[r] and
computes its own micro-batches' features (T = 0 target-only ranks, nothing sent).

Supervision: the elastic agent (in a thread of this launcher) stops every rank when one fails; we name it (rank,
role, device, exit code). Stop signals (failures.STOP_SIGNALS: SIGINT, SIGTERM, SIGUSR1, SIGHUP) reach the
launcher (the ranks run in sessions of their own), which forwards SIGUSR1 to its local ranks: they agree to stop after
the current step, drafter rank 0 writes a checkpoint, and all exit 0. The launcher is the run folder's one writer
(dflash/train/writer.py). SIGTERM from the agent itself (a peer failed) ends a rank at once. Where the replicas
stopped reaches the target ranks through a key of the launch's TCPStore (a client of its own, public API).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import logging
import os
import signal
import sys
import threading
import uuid
from collections import deque

import torch
import torch.distributed as dist

from dflash.atomic import atomic_write_json
from dflash.config import Loaded
from dflash.errors import UserError
from dflash.paths import RunFolder
from dflash.train import failures
from dflash.train.features import feature_width
from dflash.train.run import Local
from dflash.train.step import frozen_head
from dflash.train.trainer import Micro

log = logging.getLogger("dflash.train")
HEADER = 4  # index, tokens, batch, length
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
STOP_KEY = "dflash/stop_index"


# ---- launcher ------------------------------------------------------------------------------------------------
def launch_config(loaded: Loaded, placement):
    """The elastic launch configuration: one process per rank of the placement (placement.per_node on each of
    train.rendezvous.nnodes nodes), no restarts."""
    from torch.distributed.launcher.api import LaunchConfig

    rdzv = loaded.cfg.train.rendezvous
    if rdzv.nnodes > 1 and not rdzv.endpoint:
        raise UserError(f"{loaded.source}: train.rendezvous.endpoint (host:port) is required for "
                        f"{rdzv.nnodes} nodes")
    kw = dict(min_nodes=rdzv.nnodes, max_nodes=rdzv.nnodes, nproc_per_node=placement.per_node,
              run_id=rdzv.id if rdzv.endpoint else f"dflash-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
              rdzv_endpoint=rdzv.endpoint or "localhost:0", max_restarts=0, monitor_interval=0.5, role="dflash")
    if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}:
        kw["shutdown_timeout"] = 5   # survivors of a failed rank get SIGTERM, then SIGKILL after this long
    return LaunchConfig(**kw)


def worker_args(loaded: Loaded, args) -> list[str]:
    """The command line every rank runs (the same stage, inside the launcher's environment)."""
    out = ["-m", "dflash", "train", "--config", str(loaded.source), "--no-progress"]
    for item in getattr(args, "set", None) or []:
        out += ["--set", item]
    for attr, flag in (("run_dir", "--run-dir"), ("data", "--data")):
        if getattr(args, attr, None):
            out += [flag, str(getattr(args, attr))]
    return out


def torchrun_command(loaded: Loaded, placement, overrides=()) -> list[str]:
    """The equivalent torchrun command line (for clusters that start ranks themselves)."""
    cfg = launch_config(loaded, placement)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={cfg.min_nodes}",
           f"--nproc-per-node={cfg.nproc_per_node}", "--max-restarts=0"]
    rdzv = loaded.cfg.train.rendezvous
    cmd += (["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv.endpoint}", f"--rdzv-id={rdzv.id}"] if rdzv.endpoint
            else ["--standalone"])
    cmd += ["-m", "dflash", "train", "--config", str(loaded.source), "--no-progress"]
    for item in overrides:
        cmd += ["--set", item]
    return cmd


def is_rank() -> bool:
    """Whether this process is one of the launched ranks (not the launcher, nor the threads runtime)."""
    return "LOCAL_RANK" in os.environ


def writes(ctx) -> bool:
    """Whether this rank is the run's writer (drafter rank 0: rank T of the placement), which holds the run folder's
    lock where no launcher of ours holds it (ranks started by torchrun itself)."""
    return int(os.environ["RANK"]) == ctx.placement.target_ranks


def launch(ctx, args) -> int:
    """The launcher: start the ranks of this node (each runs `python -m dflash train`, which runs the lifecycle over
    `Ranks`), forward stop signals to them, name a failed rank."""
    loaded, run_dir = ctx.loaded, ctx.run_dir
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    config = launch_config(loaded, ctx.placement)
    argv = worker_args(loaded, args)
    log.info("distributed runtime: %d rank(s) on this node: %s %s", config.nproc_per_node, sys.executable,
             " ".join(argv))
    os.environ["PYTHONUNBUFFERED"] = "1"
    result: dict = {}

    def agent():  # in a thread: the agent then leaves the process's signal handlers to us
        try:
            elastic_launch(config, sys.executable)(*argv)
        except ChildFailedError as e:
            result["failures"] = e.failures
        except BaseException as e:  # noqa: BLE001
            result["error"] = e

    got: dict = {}

    def on_signal(signum, frame):
        if "signum" not in got:
            got["signum"] = signum
            log.warning("%s: asking every rank to stop after its current step and checkpoint",
                        signal.Signals(signum).name)
        for pid in local_rank_pids(run_dir):
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass

    previous = {s: signal.signal(s, on_signal) for s in failures.STOP_SIGNALS}
    try:
        t = threading.Thread(target=agent, name="elastic-agent", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.2)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if "error" in result:
        raise result["error"]
    failed = result.get("failures") or {}
    for rank, f in sorted(failed.items(), key=lambda kv: kv[1].timestamp):
        print(f"dflash train: rank {rank} = {ctx.placement.role(rank)} failed with exit code {f.exitcode}",
              file=sys.stderr)
    if failed:
        return 1
    return 128 + got["signum"] if "signum" in got else 0


def local_rank_pids(run_dir) -> list[int]:
    import json
    pids = []
    for f in RunFolder(run_dir).ranks.glob("rank-*.json"):
        try:
            info = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if info.get("host") == os.uname().nodename:
            pids.append(info["pid"])
    return pids


class DistSync:
    """The drafter group's reductions: gradients by DDP during backward; step statistics, the stop vote and the
    divergence guard's checksums here."""

    reduces_in_backward = True

    def __init__(self, group, n: int, store):
        self.group, self.n, self.store, self.holds = group, n, store, 0

    def reduce(self, rank: int, tensors, want_stop: bool = False):
        flag = torch.tensor([1.0 if want_stop else 0.0], dtype=tensors[0].dtype, device=tensors[0].device)
        packed = torch.cat([t.reshape(-1) for t in tensors] + [flag])
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=self.group)
        out, k = [], 0
        for t in tensors:
            out.append(packed[k:k + t.numel()].view_as(t))
            k += t.numel()
        return out, bool(packed[-1].item() > 0)

    def gather(self, rank: int, value: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(value) for _ in range(self.n)]
        dist.all_gather(out, value, group=self.group)
        return out

    def hold(self, rank: int, work, timeout_s: float, what: str):
        """Replica 0 runs `work()` while the others wait for a key in the launch's store (host side: no collective
        pending, so no NCCL timeout; at most timeout_s) -> work's result on replica 0, None on the others."""
        self.holds += 1
        key = f"dflash/hold/{self.holds}"
        if rank == 0:
            out = work()
            self.store.set(key, "done")
            return out
        try:
            self.store.wait([key], datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:   # torch's DistStoreError is a RuntimeError
            raise RuntimeError(f"drafter-{rank}: {what} took over {timeout_s:.0f} s (train.stall_timeout_s): "
                               f"{e}") from None
        return None


# ---- a rank's transport -----------------------------------------------------------------------------------------
class Ranks:
    """The transport of one rank (run.Transport): target rank, drafter rank, or both (co-located)."""

    reduce = "ddp"

    def open(self, ctx) -> Local:
        """Join the process group (after checking the launch matches the placement); this rank's workers."""
        pl = self.placement = ctx.placement
        self.T, self.D = pl.target_ranks, len(pl.drafters)   # T: target-only ranks
        rank = self.rank = int(os.environ["RANK"])
        _check_launch(pl, rank, self.T + self.D)
        device = self.device = pl.ranks[rank]   # every rank on a GPU or every rank on the CPU (placement.resolve)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = ctx.cfg.train.rendezvous.backend
        if backend == "auto":
            backend = "gloo" if device.type == "cpu" else "nccl"
        dist.init_process_group(backend=backend, device_id=device if backend == "nccl" else None)
        self.group = dist.new_group(list(range(self.T, self.T + self.D)))
        self.is_target, r = rank < self.T, rank - self.T
        self.name = f"target-{rank}" if self.is_target else f"drafter-{r}"
        logging.getLogger().name = self.name
        atomic_write_json(RunFolder(ctx.run_dir).ranks / f"rank-{rank}.json",
                          {"rank": rank, "name": self.name, "device": str(device), "pid": os.getpid(),
                           "backend": backend, "host": os.uname().nodename})
        self.stop = False
        for s in failures.STOP_SIGNALS:   # SIGTERM stays fatal: the agent sends it when a peer failed
            if s != signal.SIGTERM:
                signal.signal(s, lambda *a: setattr(self, "stop", True))
        # where the replicas stopped, for the target ranks: a key in the launch's own store (a client of it)
        self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                   timeout=datetime.timedelta(seconds=300))
        self.fail = failures.injector(ctx.cfg.train, self.name)
        self.fail(0)
        has_target = self.is_target or pl.colocated
        return Local([(self.name, device)] if has_target else [], [] if self.is_target else [(r, device)],
                     rank == self.T, lambda d: pl.device_name(rank), self.D)

    def heads(self, ctx, targets, devices) -> dict:
        """Co-located: this rank's own target's. Split: target rank 0 sends its embedding and LM head to every
        drafter rank."""
        if self.placement.colocated:
            return {self.device: frozen_head(targets[0].model, self.device)}
        if self.rank == 0:
            embed, head = frozen_head(targets[0].model, self.device)
            for j in range(self.T, self.T + self.D):
                dist.send(torch.tensor([DTYPES.index(embed.dtype)], device=self.device), dst=j)
                dist.send(embed.contiguous(), dst=j)
                dist.send(head.contiguous(), dst=j)
        if self.is_target:
            return {}
        V, H = ctx.drafter_config.vocab_size, ctx.drafter_config.hidden_size
        code = torch.zeros(1, dtype=torch.long, device=self.device)
        dist.recv(code, src=0)
        self.dtype = DTYPES[int(code.item())]
        e, h = (torch.empty(V, H, dtype=self.dtype, device=self.device) for _ in range(2))
        dist.recv(e, src=0)
        dist.recv(h, src=0)
        return {self.device: (e, h)}

    def sync(self, ctx) -> "DistSync":
        return DistSync(self.group, self.D, self.store)

    def share(self, point):
        """The writer's resume point, broadcast to every rank."""
        holder = [point]
        dist.broadcast_object_list(holder, src=self.T)
        return holder[0]

    def wrap(self, replicas):
        """Each replica in the drafter group's DDP (after the warm-up compiled the bare module)."""
        from torch.nn.parallel import DistributedDataParallel as DDP
        for rep in replicas:
            rep.model = DDP(rep.drafter, device_ids=[self.device] if self.device.type == "cuda" else None,
                            process_group=self.group, broadcast_buffers=False)

    def serve(self, process) -> tuple[str, dict | None]:
        if self.is_target:
            self.produce(process)
            return "completed", None
        return self.train(process)

    def gather(self, rows: dict) -> list[dict] | None:
        """Every rank's rows on the writer (device rows numbered by rank)."""
        everyone = [None] * (self.T + self.D)
        dist.all_gather_object(everyone, rows)
        for i, e in enumerate(everyone):
            e["devices"] = [{**d, "rank": i} for d in e["devices"]]
        return everyone if self.rank == self.T else None

    def close(self, status: str) -> int:
        dist.barrier()
        dist.destroy_process_group()
        return 1 if status == "failed" else 0

    # -- target ranks -------------------------------------------------------------------------------------------
    def produce(self, p) -> None:
        """Make and send this target rank's micro-batches (i % T == rank) to their replicas, until the run's end or
        the index the replicas stopped at; then the end mark to every replica."""
        target, queue_size, pending = p.targets[0], p.ctx.cfg.train.queue_size, deque()
        for i in range(p.data_index, p.end_index):
            if i % self.T != self.rank:
                continue
            if self.store.check([STOP_KEY]) and i >= int(self.store.get(STOP_KEY)):
                break                                   # the replicas stopped (a signal): nothing more to make
            target.steps += 1
            self.fail(target.steps)
            b = p.reader.batch(i)
            ids = b.input_ids.to(self.device, non_blocking=True)
            feats = target.features(ids, p.measured(i))
            msgs = [torch.tensor([i, b.tokens, *b.input_ids.shape], dtype=torch.long, device=self.device),
                    feats.contiguous(), b.input_ids.to(self.device),
                    b.loss_mask.to(device=self.device, dtype=torch.uint8)]
            pending.append([dist.isend(m, dst=self.T + i % self.D) for m in msgs] + msgs)
            while len(pending) > queue_size:
                for w in pending.popleft()[:4]:
                    w.wait()
        # the end mark: every replica drains what it was sent beyond its last step, then this
        end = torch.tensor([-1, 0, 0, 0], dtype=torch.long, device=self.device)
        pending.append([dist.isend(end, dst=j) for j in range(self.T, self.T + self.D)] + [end])
        while pending:
            for w in pending.popleft():
                if isinstance(w, dist.Work):
                    w.wait()

    # -- drafter ranks ------------------------------------------------------------------------------------------
    def train(self, p) -> tuple[str, dict | None]:
        """Run this rank's replica on micro-batches received from the target ranks (or made by its own target,
        co-located); afterwards tell the target ranks where the replicas stopped and drain what they sent beyond."""
        rep, status, failure = p.replicas[0], "completed", None
        self.width = feature_width(p.ctx.drafter_config, p.ctx.cfg.train)   # [b, S, width] per micro-batch
        take = self.receive
        if self.placement.colocated:
            take, prefetch = self.local_take(p)
        try:
            rep.run(take, lambda: self.stop, lambda: 0)
        except failures.StopRun:
            status = "interrupted"
        except (failures.Diverged, failures.NonFinite) as e:
            status, failure = "failed", failures.record(self.name, e)
            log.error("%s", e)
        if rep.rank == 0:   # every replica stopped at this step (a signal, a failed check, the time budget: all
            #                 agreed or collective): the targets make nothing beyond it
            self.store.set(STOP_KEY, str(rep.index(rep.steps, 0)))
        if self.placement.colocated:
            prefetch.shutdown(wait=True, cancel_futures=True)
        else:
            self.drain(rep)     # what the targets sent beyond the stop, then their end mark
        return status, failure

    def receive(self, index: int) -> Micro:
        """Micro-batch `index` from its target rank."""
        src = index % self.T
        hdr = torch.empty(HEADER, dtype=torch.long, device=self.device)
        dist.recv(hdr, src=src)
        got, tokens, b, s = hdr.tolist()
        if got != index:
            raise RuntimeError(f"{self.name}: expected micro-batch {index} from rank {src}, got {got}")
        feats = torch.empty(b, s, self.width, dtype=self.dtype, device=self.device)
        ids = torch.empty(b, s, dtype=torch.long, device=self.device)
        mask = torch.empty(b, s, dtype=torch.uint8, device=self.device)
        for t in (feats, ids, mask):
            dist.recv(t, src=src)
        return Micro(index, tokens, feats, ids, mask.bool())

    def local_take(self, p):
        """Co-located: (take, its reader thread). This rank's own target makes each micro-batch's features; its next
        batch (index + D: a replica's indices step by the number of replicas) is read meanwhile in a thread."""
        target, ahead = p.targets[0], {}
        prefetch = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="reader")
        read = (lambda i: p.reader.batch(i).pin()) if self.device.type == "cuda" else p.reader.batch

        def take(index: int) -> Micro:
            fut = ahead.pop(index, None)
            b = fut.result() if fut else read(index)
            if index + self.D < p.end_index:
                ahead[index + self.D] = prefetch.submit(read, index + self.D)
            ids = b.input_ids.to(self.device, non_blocking=True)
            feats = target.features(ids, p.measured(index))
            target.steps += 1
            # an inference tensor: autograd may not save it, so copy it out
            return Micro(index, b.tokens, feats.clone(), ids, b.loss_mask.to(self.device, non_blocking=True))
        return take, prefetch

    def drain(self, rep) -> None:
        """Receive and drop what the target ranks sent this replica beyond its last step, until each target sent its
        end mark [-1, ...]. Receives in the replica's own index order (as training does), so it waits on no target
        that waits on another replica: no ordering deadlock."""
        i, done = rep.index(rep.steps, 0), set()
        while len(done) < self.T:
            src = i % self.T
            if src not in done:
                hdr = torch.empty(HEADER, dtype=torch.long, device=self.device)
                dist.recv(hdr, src=src)
                index, _, b, s = hdr.tolist()
                if index < 0:
                    done.add(src)
                else:
                    for shape, dt in (((b, s, self.width), self.dtype), ((b, s), torch.long), ((b, s), torch.uint8)):
                        dist.recv(torch.empty(shape, dtype=dt, device=self.device), src=src)
            i += rep.n


def _check_launch(pl, rank: int, world: int) -> None:
    """The launcher started the processes the placement needs, numbered as it runs them."""
    if int(os.environ["WORLD_SIZE"]) != world:
        raise UserError(f"the launcher started {os.environ['WORLD_SIZE']} processes; the placement needs {world}")
    if int(os.environ.get("LOCAL_WORLD_SIZE", pl.per_node)) != pl.per_node:
        raise UserError(f"the launcher started {os.environ['LOCAL_WORLD_SIZE']} local ranks on this node; the "
                        f"placement needs {pl.per_node} (--nproc-per-node) on each of {pl.nnodes} node(s)")
    local = os.environ.get("LOCAL_RANK")
    if local is not None and int(local) != rank % pl.per_node:
        raise UserError(f"rank {rank} started as local rank {local}; the placement runs rank r on node "
                        f"r // {pl.per_node} as local rank r % {pl.per_node} (torchrun's numbering): launch with "
                        "torchrun or `python -m dflash train`, one launcher per node")
