"""The `distributed` runtime: one process per device under torchrun, the same workers as the threads runtime.

Ranks 0..T-1 are target workers, ranks T..T+D-1 drafter replicas (the placement lists, in order). Micro-batch i
is computed by target rank i % T and sent point-to-point (NCCL on GPU, gloo on CPU) to drafter rank T + i % D, with
at most `queue_size` sends in flight per target (back-pressure). Drafter replicas all-reduce their gradients in
their own process group, so their weights stay identical; drafter rank 0 writes metrics, checkpoints and the
summary exactly as in the threads runtime. torchrun supervises: a rank that dies takes the job down, named.
"""
from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections import deque

import torch
import torch.distributed as dist

from dflash.errors import UserError

log = logging.getLogger("dflash.train")
HEADER = 4  # index, tokens, batch, length
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ---- launcher (outside torchrun) -----------------------------------------------------------------------------
def torchrun_command(loaded, overrides=()) -> list[str]:
    """The torchrun command line for this config: one process per entry of train.targets + train.drafters."""
    cfg = loaded.cfg
    world = len(cfg.train.targets) + len(cfg.train.drafters)
    rdzv = cfg.train.rendezvous
    if world % rdzv.nnodes:
        raise UserError(f"{loaded.source}: {world} ranks (targets + drafters) do not split evenly over "
                        f"train.rendezvous.nnodes={rdzv.nnodes}")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={rdzv.nnodes}",
           f"--nproc-per-node={world // rdzv.nnodes}", "--max-restarts=0", "--monitor-interval=0.5"]
    if rdzv.endpoint:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv.endpoint}", f"--rdzv-id={rdzv.id}"]
    elif rdzv.nnodes == 1:
        cmd += ["--standalone"]
    else:
        raise UserError(f"{loaded.source}: train.rendezvous.endpoint (host:port) is required for "
                        f"{rdzv.nnodes} nodes")
    cmd += ["-m", "dflash", "train", "--config", loaded.source, "--no-progress"]
    for item in overrides:
        cmd += ["--set", item]
    return cmd


def role_of(loaded, rank: int) -> str:
    T = len(loaded.cfg.train.targets)
    return (f"target-{rank} ({loaded.cfg.train.targets[rank]})" if rank < T
            else f"drafter-{rank - T} ({loaded.cfg.train.drafters[rank - T]})")


def launch(loaded, args) -> int:
    if "LOCAL_RANK" in os.environ:          # we are one of torchrun's processes
        return worker_main(loaded, args)
    cmd = torchrun_command(loaded, getattr(args, "set", []))
    log.info("distributed runtime: %s", " ".join(cmd))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    tail: deque[str] = deque(maxlen=200)
    try:
        for line in proc.stdout:
            sys.stderr.write(line)
            tail.append(line)
        code = proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        code = proc.wait()
    if code:
        text = "".join(tail)
        failed = re.findall(r"rank\s*:\s*(\d+)\s*\(local_rank[^)]*\)\s*\n\s*exitcode\s*:\s*(-?\d+)", text)
        for rank, exitcode in failed:
            print(f"dflash train: rank {rank} = {role_of(loaded, int(rank))} failed with exit code {exitcode}",
                  file=sys.stderr)
        if not failed:
            print(f"dflash train: torchrun exited with code {code}", file=sys.stderr)
    return code


# ---- inside torchrun ---------------------------------------------------------------------------------------
class DistSync:
    """GradSync for processes: sums tensors over the drafter group; any replica's stop request stops all."""

    def __init__(self, group, n: int):
        self.group, self.n = group, n

    def reduce(self, rank: int, tensors, want_stop: bool = False):
        for t in tensors:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        flag = torch.tensor([1.0 if want_stop else 0.0], dtype=torch.float64, device=tensors[0].device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return tensors, bool(flag.item())


def _device(spec: str) -> torch.device:
    from dflash.train.placement import parse_device
    dev = parse_device(spec)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


def worker_main(loaded, args) -> int:
    from dflash.fingerprint import compile_cache_dir
    from dflash.train import checkpoint, compile_guard, optim
    from dflash.train.features import LayerCapture
    from dflash.train.loop import DrafterLoop, Micro, StopRun
    from dflash.train.metrics import RunMetrics, weight_checksum
    from dflash.train.reader import ShardReader
    from dflash.train.setup import build_drafter, prepare, warm_up
    from dflash.train.telemetry import GpuSampler

    cfg = loaded.cfg
    T, D = len(cfg.train.targets), len(cfg.train.drafters)
    specs = list(cfg.train.targets) + list(cfg.train.drafters)
    rank = int(os.environ["RANK"])
    if int(os.environ["WORLD_SIZE"]) != T + D:
        raise UserError(f"torchrun started {os.environ['WORLD_SIZE']} processes; the placement needs {T + D}")
    device = _device(specs[rank])
    backend = cfg.train.rendezvous.backend
    on_cpu = {str(s) == "cpu" for s in specs}
    if len(on_cpu) > 1:
        raise UserError(f"{loaded.source}: the distributed runtime needs every rank on a GPU (nccl) or every rank "
                        "on the CPU (gloo); use the threads runtime to mix them")
    if backend == "auto":
        backend = "gloo" if True in on_cpu else "nccl"
    dist.init_process_group(backend=backend, device_id=device if backend == "nccl" else None)
    drafter_group = dist.new_group(list(range(T, T + D)))
    is_target, r = rank < T, rank - T
    name = f"target-{rank}" if is_target else f"drafter-{r}"
    logging.getLogger().name = name
    fail = cfg.train.fail_at_step if cfg.train.fail_at_step and cfg.train.fail_at_step.get("worker") == name else None

    def maybe_fail(step):
        if fail and fail.get("step") == step:
            raise RuntimeError(f"{name}: injected failure at {'init' if step == 0 else f'step {step}'}")

    from dflash.atomic import atomic_write_json
    from dflash.config import results_path
    atomic_write_json(results_path(loaded, "runs", cfg.run_name, "ranks", f"rank-{rank}.json"),
                      {"rank": rank, "name": name, "device": str(device), "pid": os.getpid(), "backend": backend})
    stop = {"flag": False}
    signal.signal(signal.SIGINT, lambda *a: stop.__setitem__("flag", True))
    setup = prepare(loaded)
    setup.placement = setup.placement.__class__(setup.placement.targets, setup.placement.drafters, "distributed")
    compile_guard.use_compile_cache(compile_cache_dir(cfg.results_dir, setup.env["hash"]))
    reader = ShardReader(setup.data_dir, cfg.train.batch_size, cfg.seed, setup.extra["pad_id"])
    maybe_fail(0)
    t_start = time.perf_counter()
    dtype = None

    # embedding + LM head: target rank 0 has them; it sends them to every drafter rank
    if is_target:
        from dflash.target import load_target
        model = load_target(cfg.target, device=device, seed=cfg.seed)
        capture = LayerCapture(model, setup.drafter_config.target_layer_ids)
        embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        dtype = embed.dtype
        if rank == 0:
            for j in range(T, T + D):
                dist.send(torch.tensor([DTYPES.index(dtype)], device=device), dst=j)
                dist.send(embed.detach().contiguous(), dst=j)
                dist.send(head.detach().contiguous(), dst=j)
    else:
        V, H = setup.drafter_config.vocab_size, setup.drafter_config.hidden_size
        code_t = torch.zeros(1, dtype=torch.long, device=device)
        dist.recv(code_t, src=0)
        dtype = DTYPES[int(code_t.item())]
        e, h = torch.empty(V, H, dtype=dtype, device=device), torch.empty(V, H, dtype=dtype, device=device)
        dist.recv(e, src=0)
        dist.recv(h, src=0)
        drafter = build_drafter(setup, e, h, device)
        opt, sched = optim.build([p for p in drafter.parameters() if p.requires_grad], cfg.train, device)

    # resume point, decided by drafter rank 0 and broadcast to every rank
    pos = torch.zeros(2, dtype=torch.long)
    if rank == T:
        latest = checkpoint.resumable(setup)
        if latest is not None:
            state = checkpoint.load(latest, drafter, opt, sched)
            pos = torch.tensor([state["step"], state["data_index"]])
            log.info("resuming from %s: step %d, data index %d", latest, *pos.tolist())
    pos = pos.to(device) if backend == "nccl" else pos
    dist.broadcast(pos, src=T)
    start_step, data_index = (int(x) for x in pos.tolist())
    if not is_target and rank != T and start_step:
        checkpoint.load(checkpoint.latest(setup.run_dir), drafter, opt, sched)
    per_step = D * cfg.train.grad_accum
    end_index = data_index + max(0, cfg.train.steps - start_step) * per_step

    code = 0
    if is_target:
        pending: deque = deque()
        produced = 0
        for i in range(data_index, end_index):
            if i % T != rank:
                continue
            produced += 1
            maybe_fail(produced)
            b = reader.batch(i)
            dst = T + i % D
            with torch.inference_mode():
                feats = capture(b.input_ids.to(device, non_blocking=True))
            msgs = [torch.tensor([i, b.tokens, *b.input_ids.shape], dtype=torch.long, device=device),
                    feats.contiguous(), b.input_ids.to(device), b.loss_mask.to(device=device, dtype=torch.uint8)]
            pending.append([dist.isend(m, dst=dst) for m in msgs] + msgs)
            while len(pending) > cfg.train.queue_size:
                for w in pending.popleft()[:4]:
                    w.wait()
        while pending:
            for w in pending.popleft()[:4]:
                w.wait()
    else:
        shapes = reader.shapes()
        setup.extra["shapes"] = shapes
        record = warm_up(drafter, setup, device, shapes)
        if setup.compile:
            compile_guard.forbid_recompiles()
        compile_guard.configure_thread(len(shapes))
        k, H = len(setup.drafter_config.target_layer_ids), setup.drafter_config.hidden_size
        metrics = RunMetrics(setup, progress=False) if r == 0 else None
        sampler = GpuSampler([device])
        if metrics:
            metrics.sampler = sampler
            metrics.set_warmup([record], time.perf_counter() - t_start)
            metrics.start(start_step, [])
        else:
            sampler.start()

        def take(index: int) -> Micro:
            src = index % T
            hdr = torch.empty(HEADER, dtype=torch.long, device=device)
            dist.recv(hdr, src=src)
            got, tokens, b, s = hdr.tolist()
            if got != index:
                raise RuntimeError(f"{name}: expected micro-batch {index} from rank {src}, got {got}")
            feats = torch.empty(b, s, k * H, dtype=dtype, device=device)
            ids = torch.empty(b, s, dtype=torch.long, device=device)
            mask = torch.empty(b, s, dtype=torch.uint8, device=device)
            for t in (feats, ids, mask):
                dist.recv(t, src=src)
            return Micro(index, tokens, feats, ids, mask.bool())

        loop = DrafterLoop(r, D, device, setup, drafter, opt, sched, DistSync(drafter_group, D), metrics,
                           start_step, data_index, fail=maybe_fail)
        status = "completed"
        try:
            loop.run(take, lambda: stop["flag"], lambda: 0)
        except StopRun:
            status, code = "interrupted", 130
        sampler.stop()
        peak = round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if device.type == "cuda" else None
        desc = {"name": name, "role": "drafter", "device": str(device), "steps": loop.steps,
                "checksum": weight_checksum(drafter),
                "peak_memory_gb": peak, "util_mean": sampler.mean(device)}
    if is_target:
        desc = {"name": name, "role": "target", "device": str(device), "steps": produced,
                "peak_memory_gb": round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
                if device.type == "cuda" else None, "util_mean": None}
    everyone = [None] * (T + D)
    dist.all_gather_object(everyone, desc)
    if rank == T:
        devices = [{"device": d["device"], "roles": [d["role"]], "peak_memory_gb": d["peak_memory_gb"],
                    "util_mean": d["util_mean"], "rank": i} for i, d in enumerate(everyone)]
        checksums = [d.pop("checksum") for d in everyone if "checksum" in d]
        metrics.finish(setup, everyone, status=status, resumed_from=start_step or None, devices=devices,
                       checksums=checksums)
    dist.barrier()
    dist.destroy_process_group()
    return code
