"""A target:drafter GPU split suggested from the newest run's measured time split.

Per micro-batch a target GPU spends t = time_split_s.target / grad_accum (the target forward of the micro-batches one
optimizer step consumed) and a drafter GPU d = (time_split_s.drafter + time_split_s.optimizer) / grad_accum (its
forward+backward and its share of the optimizer step). T target GPUs make T/t micro-batches per second, D drafter
GPUs take D/d; the pipeline runs at min(T/t, D/d), so the split of G GPUs that maximises it balances T/t against
D/d and the faster side waits 1 - slower/faster of the time. When every GPU runs both roles (co-located) the two
streams share each GPU, which balances by itself; the suggestion then says what share of each GPU each side takes.
A split run is also compared with co-locating: G GPUs each running target and drafter take about G/(t+d)
micro-batches per second when each GPU is kept busy (on one H200: t+d = 0.225 s predicts 10.4 Ktok/s where 1 target
+ 1 drafter measured 11.2, the two streams overlapping a little); it is named when it beats the best split by 2%.
"""
from __future__ import annotations

from dflash.device_names import normalize, rank_names, same_devices
from dflash.report.history import to_float


def gpu_roles(summary: dict) -> dict[str, set[str]]:
    """{GPU name: its roles} from summary.devices, else from config.train.targets/drafters; CPU devices left out. On
    several nodes a GPU is named by its node (`node1/cuda:0`, dflash/device_names.py), so every node's GPUs count."""
    roles: dict[str, set[str]] = {}
    for d in summary.get("devices") or []:
        if isinstance(d, dict) and d.get("device") is not None:
            roles.setdefault(normalize(d["device"]), set()).update(r for r in d.get("roles") or [] if isinstance(r, str))
    if not roles:
        train = (summary.get("config") or {}).get("train") or {}
        targets, drafters = list(train.get("targets") or []), list(train.get("drafters") or [])
        nnodes = int(to_float((train.get("rendezvous") or {}).get("nnodes")) or 1)
        if nnodes > 1:   # the distributed runtime's ranks as Placement.ranks lists them, rank r on node r // per_node
            both = same_devices(targets, drafters)
            kinds = [("target", "drafter")] * len(drafters) if both else \
                [("target",)] * len(targets) + [("drafter",)] * len(drafters)
            named = zip(rank_names(drafters if both else targets + drafters, nnodes), kinds)
        else:
            named = [(normalize(d), ("target",)) for d in targets] + [(normalize(d), ("drafter",)) for d in drafters]
        for name, kind in named:
            roles.setdefault(name, set()).update(kind)
    return {dev: r for dev, r in roles.items() if not dev.split("/")[-1].startswith("cpu")}


def _n(k: int, word: str) -> str:
    return f"{k} {word}{'' if k == 1 else 's'}"


def _best_split(g: int, t: float, d: float, now: int | None) -> int:
    """The number of target GPUs out of g (1..g-1) that maximises min(T/t, (g-T)/d); a tie keeps `now`."""
    rate = lambda k: min(k / t, (g - k) / d)  # noqa: E731
    return max(range(1, g), key=lambda k: (round(rate(k), 9), k == now, -abs(k - (now or 0))))


def suggest(summary: dict) -> dict | None:
    """The split for the run's GPUs, with a one-sentence reason; None without GPUs or a measured time split."""
    split = summary.get("time_split_s") if isinstance(summary.get("time_split_s"), dict) else {}
    tgt_s, drf_s, opt_s = (to_float(split.get(k)) for k in ("target", "drafter", "optimizer"))
    accum = to_float(((summary.get("config") or {}).get("train") or {}).get("grad_accum")) or 1.0
    roles = gpu_roles(summary)
    targets = sorted(dev for dev, r in roles.items() if "target" in r)
    drafters = sorted(dev for dev, r in roles.items() if "drafter" in r)
    if not tgt_s or not drf_s or tgt_s <= 0 or drf_s <= 0 or accum <= 0 or not targets or not drafters:
        return None
    t, d = tgt_s / accum, (drf_s + max(opt_s or 0.0, 0.0)) / accum
    g, n_t, n_d = len(roles), len(targets), len(drafters)
    costs = f"target {t:.2f} s vs drafter {d:.2f} s per micro-batch"
    out = {"run_id": summary.get("run_id"), "gpus": g, "target_s": round(t, 5), "drafter_s": round(d, 5),
           "current": {"targets": n_t, "drafters": n_d}, "colocated": set(targets) == set(drafters) == set(roles),
           "suggested": None, "waiting": None, "wait_share": None, "expected_speedup": None,
           "colocated_speedup": None}
    share = t / (t + d)
    if out["colocated"]:
        out["target_share"] = round(share, 4)
        both = "the GPU runs both" if g == 1 else f"{g} GPUs each run both"
        apart = f" (as separate GPUs: {g * share:.1f} targets : {g * (1 - share):.1f} drafters)" if g > 1 else ""
        out["sentence"] = (f"{costs}: {both} (co-located), which balances by itself; each GPU spends {share:.0%} of its "
                           f"work on the target and {1 - share:.0%} on the drafter{apart}.")
        return out
    if g < 2:
        return None
    disjoint = not set(targets) & set(drafters)
    k = _best_split(g, t, d, n_t if disjoint else None)
    out["suggested"] = {"targets": k, "drafters": g - k}
    rate_new = min(k / t, (g - k) / d)
    now = f"now {n_t} : {n_d}"
    if disjoint:
        make, take = n_t / t, n_d / d
        side, wait = ("target", 1 - take / make) if make > take else ("drafter", 1 - make / take)
        idle = wait >= 0.005                            # below half a percent: balanced
        out.update(waiting=side if idle else None, wait_share=round(wait, 4),
                   expected_speedup=round(rate_new / min(make, take), 4))
        now += f", the {side} GPUs wait {wait:.0%} of the time" if idle else ", neither side waits"
        coloc = g / (t + d)
        out["colocated_speedup"] = round(coloc / min(make, take), 4)
    else:
        now += ", some GPUs run both"
    verb = "keep" if disjoint and (k, g - k) == (n_t, n_d) else "run"
    gain = f"; up to {out['expected_speedup']:.2f}x the micro-batches per second" \
        if out["expected_speedup"] and out["expected_speedup"] >= 1.005 else ""
    if disjoint and coloc >= 1.02 * rate_new:
        gain += (f"; co-locating (the same GPUs in train.targets and train.drafters: a target and a drafter replica "
                 f"on each) up to {out['colocated_speedup']:.2f}x")
    out["sentence"] = f"{costs}: on {g} GPUs {verb} {_n(k, 'target')} : {_n(g - k, 'drafter')} ({now}){gain}."
    return out
