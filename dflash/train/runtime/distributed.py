"""The `distributed` runtime: one process per device, started by torch's elastic launcher, the same trainer.

Ranks 0..T-1 are target workers, ranks T..T+D-1 drafter replicas (the placement lists, in order; rank r runs on
node r // nproc-per-node: dflash/train/placement.py maps rank -> worker -> node -> device). Micro-batch i
is computed by target rank i % T and sent point-to-point (NCCL on GPU, gloo on CPU) to drafter rank T + i % D, with
at most `queue_size` sends in flight per target (back-pressure). Drafter replicas are one DistributedDataParallel
group: bucketed gradient all-reduces overlap the backward. Drafter rank 0 writes metrics, checkpoints and the
summary exactly as in the threads runtime.
Co-located (train.targets == train.drafters): D ranks, rank r runs a target and drafter replica r on drafters[r] and
computes its own micro-batches' features (T = 0 target-only ranks, nothing sent).

Supervision: the elastic agent (in a thread of this launcher) stops every rank when one fails; we name it (rank,
role, device, exit code). Stop signals (SIGINT, SIGTERM, SIGUSR1) reach the launcher, which forwards SIGUSR1 to
its local ranks: they agree to stop after the current step, drafter rank 0 writes a checkpoint, and all exit 0.
SIGTERM from the agent itself (a peer failed) ends a rank at once.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import datetime
import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections import deque

import torch
import torch.distributed as dist

from dflash.errors import UserError
from dflash.train.metrics import DeviceTimer, seconds
from dflash.train.telemetry import GpuSampler

log = logging.getLogger("dflash.train")
HEADER = 4  # index, tokens, batch, length
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
STOP_KEY = "dflash/stop_index"


# ---- launcher ------------------------------------------------------------------------------------------------
def launch_config(loaded, placement):
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


def worker_args(loaded, args) -> list[str]:
    """The command line every rank runs (the same stage, inside the launcher's environment)."""
    out = ["-m", "dflash", "train", "--config", str(loaded.source), "--no-progress"]
    for item in getattr(args, "set", None) or []:
        out += ["--set", item]
    for attr, flag in (("run_dir", "--run-dir"), ("data", "--data")):
        if getattr(args, attr, None):
            out += [flag, str(getattr(args, attr))]
    return out


def torchrun_command(loaded, placement, overrides=()) -> list[str]:
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


def launch(ctx, args) -> int:
    loaded, run_dir = ctx.loaded, ctx.run_dir
    if is_rank():
        return worker_main(ctx, args)
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

    previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
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
    failures = result.get("failures") or {}
    for rank, f in sorted(failures.items(), key=lambda kv: kv[1].timestamp):
        print(f"dflash train: rank {rank} = {ctx.placement.role(rank)} failed with exit code {f.exitcode}",
              file=sys.stderr)
    if failures:
        return 1
    return 128 + got["signum"] if "signum" in got else 0


def local_rank_pids(run_dir) -> list[int]:
    import json
    from pathlib import Path
    pids = []
    for f in Path(run_dir, "ranks").glob("rank-*.json"):
        try:
            info = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if info.get("host") == os.uname().nodename:
            pids.append(info["pid"])
    return pids


# ---- inside a rank ---------------------------------------------------------------------------------------------
class DistSync:
    """The drafter group's reductions: gradients by DDP during backward; step statistics, the stop vote and the
    divergence guard's checksums here."""

    reduces_in_backward = True

    def __init__(self, group, n: int):
        self.group, self.n = group, n

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

    def hold(self, rank: int, work, timeout_s: float):
        """Replica 0 runs `work()` while the others wait for a key in the rendezvous store (host side: no collective
        pending, so no NCCL timeout; at most timeout_s) -> work's result on replica 0, None on the others."""
        store = dist.distributed_c10d._get_default_store()
        self.holds = getattr(self, "holds", 0) + 1
        key = f"dflash/hold/{self.holds}"
        if rank == 0:
            out = work()
            store.set(key, "done")
            return out
        try:
            store.wait([key], datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:   # torch's DistStoreError is a RuntimeError
            raise RuntimeError(f"drafter-{rank}: drafter-0's in-training evaluation (train.eval_every) took over "
                               f"{timeout_s:.0f} s (train.stall_timeout_s): {e}") from None
        return None


def worker_main(ctx, args) -> int:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dflash.atomic import atomic_write_json
    from dflash.evaluate import live
    from dflash.fingerprint import compile_cache_dir
    from dflash.train import checkpoint, compile_guard, summary
    from dflash.train.context import set_shapes
    from dflash.train.features import feature_width, run_capture
    from dflash.train.metrics import RunMetrics
    from dflash.train.step import build_drafter, frozen_head
    from dflash.train.trainer import Diverged, Micro, NonFinite, Replica, StopRun, weight_checksum

    cfg, pl = ctx.cfg, ctx.placement
    coloc = pl.colocated
    T, D = pl.target_ranks, len(pl.drafters)   # T: target-only ranks
    rank = int(os.environ["RANK"])
    if int(os.environ["WORLD_SIZE"]) != T + D:
        raise UserError(f"the launcher started {os.environ['WORLD_SIZE']} processes; the placement needs {T + D}")
    if int(os.environ.get("LOCAL_WORLD_SIZE", pl.per_node)) != pl.per_node:
        raise UserError(f"the launcher started {os.environ['LOCAL_WORLD_SIZE']} local ranks on this node; the "
                        f"placement needs {pl.per_node} (--nproc-per-node) on each of {pl.nnodes} node(s)")
    local = os.environ.get("LOCAL_RANK")
    if local is not None and int(local) != rank % pl.per_node:
        raise UserError(f"rank {rank} started as local rank {local}; the placement runs rank r on node "
                        f"r // {pl.per_node} as local rank r % {pl.per_node} (torchrun's numbering): launch with "
                        "torchrun or `python -m dflash train`, one launcher per node")
    device = pl.ranks[rank]   # every rank on a GPU or every rank on the CPU (placement.resolve)
    where = pl.device_name(rank)   # summaries name it: cuda:N on one node, nodeN/cuda:M on several
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = cfg.train.rendezvous.backend
    if backend == "auto":
        backend = "gloo" if device.type == "cpu" else "nccl"
    dist.init_process_group(backend=backend, device_id=device if backend == "nccl" else None)
    drafter_group = dist.new_group(list(range(T, T + D)))
    is_target, r = rank < T, rank - T
    name = f"target-{rank}" if is_target else f"drafter-{r}"
    logging.getLogger().name = name
    fail = cfg.train.fail_at_step if cfg.train.fail_at_step and cfg.train.fail_at_step.get("worker") == name else None

    def maybe_fail(step):
        if fail and fail.get("step") == step:
            raise RuntimeError(f"{name}: injected failure at {'init' if step == 0 else f'step {step}'}")

    atomic_write_json(ctx.run_dir / "ranks" / f"rank-{rank}.json",
                      {"rank": rank, "name": name, "device": str(device), "pid": os.getpid(), "backend": backend,
                       "host": os.uname().nodename})
    stop = {"flag": False}
    for s in (signal.SIGINT, signal.SIGUSR1):   # SIGTERM stays fatal: the agent sends it when a peer failed
        signal.signal(s, lambda *a: stop.__setitem__("flag", True))
    compile_guard.use_compile_cache(compile_cache_dir(cfg.results_dir, ctx.env["hash"]))
    reader = ctx.open_reader()
    set_shapes(ctx, reader.shapes())
    maybe_fail(0)
    t_start = time.perf_counter()

    # embedding + LM head: target rank 0 has them; it sends them to every drafter rank (co-located: its own target's)
    if is_target or coloc:
        from dflash.target import load_target
        model = load_target(cfg.target, device=device, seed=cfg.seed)
        capture = run_capture(model, ctx)
    if rank == 0 and not coloc:
        embed, head = frozen_head(model, device)
        for j in range(T, T + D):
            dist.send(torch.tensor([DTYPES.index(embed.dtype)], device=device), dst=j)
            dist.send(embed.contiguous(), dst=j)
            dist.send(head.contiguous(), dst=j)
    if not is_target:
        if coloc:
            e, h = frozen_head(model, device)
        else:
            V, H = ctx.drafter_config.vocab_size, ctx.drafter_config.hidden_size
            code_t = torch.zeros(1, dtype=torch.long, device=device)
            dist.recv(code_t, src=0)
            dtype = DTYPES[int(code_t.item())]
            e, h = torch.empty(V, H, dtype=dtype, device=device), torch.empty(V, H, dtype=dtype, device=device)
            dist.recv(e, src=0)
            dist.recv(h, src=0)
        from dflash.train import memory
        longest = max(n for _, n in ctx.shapes)
        resident = sum(p.numel() * p.element_size() for p in model.parameters()) \
            if coloc and device.type == "cuda" else 0     # this rank's own target (the threads runtime counts it so)
        memory.check(ctx.drafter_config, cfg.train, longest, device, ctx.backend, resident=resident,
                     num_anchors=ctx.anchors_for(longest), compiled=ctx.compile, reduce="ddp" if D > 1 else "none")
        metrics = RunMetrics(ctx, progress=False) if r == 0 else None
        sync = DistSync(drafter_group, D)
        rep = Replica(ctx, r, D, device, build_drafter(ctx, e, h, device), sync, metrics, fail=maybe_fail)
        live.attach(ctx, [rep], model if coloc else None)

    # resume point: drafter rank 0 picks the verified checkpoint and resumes from it; one broadcast gives every rank
    # its path (the other replicas load the same one) and the step and data index (the targets start there)
    holder = [None]
    if rank == T:
        latest = checkpoint.resumable(ctx)
        if latest:
            rep.resume(latest)
            log.info("resuming from %s: step %d, data index %d", latest, rep.start_step, rep.data_index)
        holder[0] = (str(latest or ""), rep.start_step, rep.data_index)
    dist.broadcast_object_list(holder, src=T)
    latest, start_step, data_index = holder[0]
    if not is_target and r != 0 and latest:
        rep.resume(latest)
    per_step = ctx.batches_per_step
    end_index = data_index + max(0, cfg.train.steps - start_step) * per_step

    code, status, failure = 0, "completed", None
    store = dist.distributed_c10d._get_default_store()
    if is_target:
        warm = None
        if cfg.train.compile_target:   # compiled for every bucket shape before the first micro-batch
            capture.compile()
            warm = capture.warm_up(device, ctx.shapes, ctx.drafter_config.vocab_size, ctx.compiled_workers)
            warm["device"] = where
            log.info("warm-up of %s on %s (compiled target): %d graph(s), %d cache hit(s), %.1f s", name, device,
                     warm["graphs"], warm["cache_hits"], warm["seconds"])
            compile_guard.forbid_recompiles()
            compile_guard.configure_thread(len(ctx.shapes), ctx.compiled_workers)
        pending: deque = deque()
        produced = 0
        # the forward time of the measured micro-batches (those of the steps past train.warmup_steps_excluded):
        # drafter rank 0 puts it in the summary's time split, which the report's placement suggestion reads
        measured_from = data_index + cfg.train.warmup_steps_excluded * per_step
        clock = ForwardClock(device)
        sampler, sampling = GpuSampler([device]), False     # started with the first measured micro-batch
        for i in range(data_index, end_index):
            if i % T != rank:
                continue
            if store.check([STOP_KEY]) and i >= int(store.get(STOP_KEY)):
                break                                   # the replicas stopped (a signal): nothing more to make
            produced += 1
            maybe_fail(produced)
            b = reader.batch(i)
            dst = T + i % D
            ids = b.input_ids.to(device, non_blocking=True)
            if i >= measured_from and not sampling:
                sampler.start()
                sampling = True
            with torch.inference_mode(), clock if i >= measured_from else contextlib.nullcontext():
                feats = capture.guarded(ids)
            msgs = [torch.tensor([i, b.tokens, *b.input_ids.shape], dtype=torch.long, device=device),
                    feats.contiguous(), b.input_ids.to(device), b.loss_mask.to(device=device, dtype=torch.uint8)]
            pending.append([dist.isend(m, dst=dst) for m in msgs] + msgs)
            while len(pending) > cfg.train.queue_size:
                for w in pending.popleft()[:4]:
                    w.wait()
        # the end mark: every replica drains what it was sent beyond its last step, then this
        end = torch.tensor([-1, 0, 0, 0], dtype=torch.long, device=device)
        pending.append([dist.isend(end, dst=j) for j in range(T, T + D)] + [end])
        while pending:
            for w in pending.popleft():
                if isinstance(w, dist.Work):
                    w.wait()
        sampler.stop()
        desc = {"name": name, "role": "target", "device": where, "steps": produced,
                "forward_s": clock.mean(), "forward_batches": clock.n,
                "peak_memory_gb": _peak(device), "util_mean": sampler.mean(device), "warmup": warm}
    else:
        records = [{**rep.warm_up(), "device": where}]    # compiles on the bare module, before DDP wraps it
        if coloc and cfg.train.compile_target:
            capture.compile()
            records.append({**capture.warm_up(device, ctx.shapes, ctx.drafter_config.vocab_size, ctx.compiled_workers),
                            "device": where})
        if ctx.compile or (coloc and cfg.train.compile_target):
            compile_guard.forbid_recompiles()
        compile_guard.configure_thread(len(ctx.shapes), ctx.compiled_workers)
        rep.model = DDP(rep.drafter, device_ids=[device] if device.type == "cuda" else None,
                        process_group=drafter_group, broadcast_buffers=False)
        width = feature_width(ctx.drafter_config, cfg.train)   # [b, S, width] features per micro-batch
        sampler = GpuSampler([device])
        if metrics:
            metrics.sampler = sampler
            metrics.set_warmup(records, time.perf_counter() - t_start)
            metrics.start(start_step, getattr(rep, "resumed", {}).get("metrics"))
        else:
            sampler.start()

        prefetch = None
        if coloc:   # this rank's own target: its forward time (measured steps) and the next batch read meanwhile
            clock = ForwardClock(device)
            measured_from = data_index + cfg.train.warmup_steps_excluded * per_step
            ahead: dict = {}
            prefetch = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="reader")
            read = (lambda i: reader.batch(i).pin()) if device.type == "cuda" else reader.batch

        def take_local(index: int) -> Micro:
            """Co-located: this rank's own target makes the micro-batch's features. Its next batch (index + D: a
            replica's indices step by the number of replicas) is read meanwhile in a thread."""
            fut = ahead.pop(index, None)
            b = fut.result() if fut else read(index)
            if index + D < end_index:
                ahead[index + D] = prefetch.submit(read, index + D)
            ids = b.input_ids.to(device, non_blocking=True)
            with torch.inference_mode(), clock if index >= measured_from else contextlib.nullcontext():
                feats = capture.guarded(ids)
            # an inference tensor: autograd may not save it, so copy it out
            return Micro(index, b.tokens, feats.clone(), ids, b.loss_mask.to(device, non_blocking=True))

        def take(index: int) -> Micro:
            src = index % T
            hdr = torch.empty(HEADER, dtype=torch.long, device=device)
            dist.recv(hdr, src=src)
            got, tokens, b, s = hdr.tolist()
            if got != index:
                raise RuntimeError(f"{name}: expected micro-batch {index} from rank {src}, got {got}")
            feats = torch.empty(b, s, width, dtype=dtype, device=device)
            ids = torch.empty(b, s, dtype=torch.long, device=device)
            mask = torch.empty(b, s, dtype=torch.uint8, device=device)
            for t in (feats, ids, mask):
                dist.recv(t, src=src)
            return Micro(index, tokens, feats, ids, mask.bool())

        try:
            rep.run(take_local if coloc else take, lambda: stop["flag"], lambda: 0)
        except StopRun:
            status = "interrupted"
        except (Diverged, NonFinite) as e:
            status, code = "failed", 1
            failure = {"kind": "diverged" if isinstance(e, Diverged) else "non_finite", "worker": name,
                       "message": str(e), **getattr(e, "info", {})}
            log.error("%s", e)
        if r == 0:   # every replica stopped at this step (a signal, a failed check, the time budget: all agreed or
            #          collective): the targets make nothing beyond it
            store.set(STOP_KEY, str(rep.index(rep.steps, 0)))
        if prefetch:
            prefetch.shutdown(wait=True, cancel_futures=True)
        if not coloc:
            _drain(rep, T, width, dtype, device)     # what the targets sent beyond the stop, then their end mark
        sampler.stop()
        desc = {"name": name, "role": "drafter", "device": where, "steps": rep.steps,
                "checksum": weight_checksum(rep.drafter).tolist(), "peak_memory_gb": _peak(device),
                "util_mean": sampler.mean(device, *(metrics.measured_window() if metrics else (None, None)))}
        if coloc:
            desc.update(roles=["target", "drafter"], forward_s=clock.mean(), forward_batches=clock.n)
    everyone = [None] * (T + D)
    dist.all_gather_object(everyone, desc)
    if rank == T:
        devices = [{"device": d["device"], "roles": d.pop("roles", [d["role"]]),
                    "peak_memory_gb": d["peak_memory_gb"], "util_mean": d["util_mean"], "rank": i}
                   for i, d in enumerate(everyone)]
        checksums = [d.pop("checksum") for d in everyone if "checksum" in d]
        warm = [w for d in everyone if (w := d.pop("warmup", None))]
        if warm:   # the compiled targets' warm-up records join the summary's compile section (this rank writes it)
            metrics.set_warmup(metrics.warmup + warm, metrics.warmup_s)
        timed = [(d["forward_s"], d["forward_batches"]) for d in everyone if d.get("forward_batches")]
        if timed:   # the mean target forward per micro-batch, times the micro-batches of one replica's step
            mean = sum(s * n for s, n in timed) / sum(n for _, n in timed)
            metrics.set_split("target", mean * cfg.train.grad_accum)
        summary.write(ctx, metrics, everyone, status, devices, checksums=checksums, failure=failure)
    dist.barrier()
    dist.destroy_process_group()
    return code


def _drain(rep, T: int, width: int, dtype, device):
    """Receive and drop what the target ranks sent this replica beyond its last step, until each target sent its
    end mark [-1, ...]. Receives in the replica's own index order (as training does), so it waits on no target
    that waits on another replica: no ordering deadlock."""
    i, done = rep.index(rep.steps, 0), set()
    while len(done) < T:
        src = i % T
        if src not in done:
            hdr = torch.empty(HEADER, dtype=torch.long, device=device)
            dist.recv(hdr, src=src)
            index, _, b, s = hdr.tolist()
            if index < 0:
                done.add(src)
            else:
                for shape, dt in (((b, s, width), dtype), ((b, s), torch.long), ((b, s), torch.uint8)):
                    dist.recv(torch.empty(shape, dtype=dt, device=device), src=src)
        i += rep.n


class ForwardClock(DeviceTimer):
    """`with clock:` times a target forward; CUDA event pairs are resolved in batches, behind the newest ones (so the
    host never waits for a forward still in flight), and only their running sum is kept."""

    KEEP = 16

    def __init__(self, device):
        super().__init__(device)
        self.total, self.n = 0.0, 0

    def __exit__(self, *exc):
        super().__exit__(*exc)
        if len(self.items) >= 4 * self.KEEP:
            self._settle(self.KEEP)
        return False

    def _settle(self, keep: int):
        done, self.items = self.items[:len(self.items) - keep], self.items[len(self.items) - keep:]
        self.total += seconds(done)
        self.n += len(done)

    def mean(self) -> float | None:
        self._settle(0)
        return self.total / self.n if self.n else None


def _peak(device):
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if device.type == "cuda" else None
