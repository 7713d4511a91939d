"""The suggested target:drafter GPU split (dflash/report/placement.py) from a run's measured time split."""
import copy

import pytest

from dflash.report.placement import suggest
from support.report_factory import summary


def _with_split(target, drafter, optimizer=0.0, accum=1, s=None):
    s = copy.deepcopy(s or summary(1))
    s["time_split_s"] = {"queue_wait": 0.01, "target": target, "drafter": drafter, "optimizer": optimizer}
    s["config"]["train"]["grad_accum"] = accum
    return s


def test_a_drafter_twice_the_target_gets_more_drafter_gpus():
    # the seed split 5 targets : 3 drafters; per micro-batch (grad_accum 2) target 0.2 s, drafter 0.35+0.05 s
    p = suggest(_with_split(0.4, 0.7, 0.1, accum=2))
    assert p["gpus"] == 8 and p["current"] == {"targets": 5, "drafters": 3} and not p["colocated"]
    assert (p["target_s"], p["drafter_s"]) == (0.2, 0.4)
    assert p["suggested"] == {"targets": 3, "drafters": 5}              # min(3/0.2, 5/0.4) = 12.5 mb/s, the best
    assert p["waiting"] == "target" and p["wait_share"] == pytest.approx(0.7)   # targets make 25, drafters take 7.5
    assert p["expected_speedup"] == pytest.approx(12.5 / 7.5, abs=1e-4)
    assert p["colocated_speedup"] == pytest.approx((8 / 0.6) / 7.5, abs=1e-4)   # 13.3 mb/s: beats the best split
    assert p["sentence"] == ("target 0.20 s vs drafter 0.40 s per micro-batch: on 8 GPUs run 3 targets : 5 drafters "
                             "(now 5 : 3, the target GPUs wait 70% of the time); up to 1.67x the micro-batches per second; "
                             "co-locating (the same GPUs in train.targets and train.drafters: a target and a drafter "
                             "replica on each) up to 1.78x.")


def test_two_gpus_split_one_to_one_name_co_location():
    """The measured x2 runs (bench/results/2026-11-29-x2-multigpu): 1 : 1 is the best split, co-locating is better."""
    s = _with_split(0.0853, 0.1276, 0.0124)
    s["devices"] = [{"device": "cuda:0", "roles": ["target"]}, {"device": "cuda:1", "roles": ["drafter"]}]
    p = suggest(s)
    assert p["suggested"] == p["current"] == {"targets": 1, "drafters": 1}
    assert p["colocated_speedup"] == pytest.approx((2 / 0.2253) / (1 / 0.14), abs=1e-3)     # ~1.24x
    assert "keep 1 target : 1 drafter" in p["sentence"] and "co-locating" in p["sentence"]


def test_a_balanced_run_keeps_its_split():
    p = suggest(_with_split(0.5, 0.25, 0.05))                           # 5/0.5 == 3/0.3
    assert p["suggested"] == p["current"] == {"targets": 5, "drafters": 3}
    assert p["waiting"] is None and p["wait_share"] == pytest.approx(0.0, abs=1e-9) and p["expected_speedup"] == pytest.approx(1.0)
    assert "keep 5 targets : 3 drafters (now 5 : 3, neither side waits)." in p["sentence"]   # co-located: 8/0.8, no gain
    assert p["colocated_speedup"] == pytest.approx(1.0)


def test_drafters_that_wait_get_more_target_gpus():
    s = _with_split(0.6, 0.05, 0.05)
    s["devices"] = [{"device": f"cuda:{i}", "roles": ["target" if i < 2 else "drafter"]} for i in range(4)]
    p = suggest(s)
    assert p["current"] == {"targets": 2, "drafters": 2} and p["suggested"] == {"targets": 3, "drafters": 1}
    assert p["waiting"] == "drafter" and p["wait_share"] == pytest.approx(1 - (2 / 0.6) / (2 / 0.1), abs=1e-4)


def test_colocated_gpus_balance_by_themselves_and_the_share_is_named():
    s = _with_split(0.3, 0.1, 0.1)
    s["devices"] = [{"device": f"cuda:{i}", "roles": ["target", "drafter"]} for i in range(4)]
    p = suggest(s)
    assert p["colocated"] and p["suggested"] is None and p["target_share"] == pytest.approx(0.6)
    assert "4 GPUs each run both (co-located), which balances by itself" in p["sentence"]
    assert "60% of its work on the target and 40% on the drafter (as separate GPUs: 2.4 targets : 1.6 drafters)" in p["sentence"]


def test_devices_missing_fall_back_to_the_config_device_lists():
    s = _with_split(0.4, 0.7, 0.1, accum=2)
    del s["devices"]
    assert suggest(s)["suggested"] == {"targets": 3, "drafters": 5}


@pytest.mark.parametrize("damage", ["no split", "split None", "target None", "drafter zero", "no devices",
                                    "cpu only", "accum None", "split not a dict"])
def test_missing_or_none_fields_give_no_suggestion(damage):
    s = _with_split(0.4, 0.7, 0.1, accum=2)
    if damage == "no split":
        del s["time_split_s"]
    elif damage == "split None":
        s["time_split_s"] = None
    elif damage == "target None":
        s["time_split_s"]["target"] = None
    elif damage == "drafter zero":
        s["time_split_s"]["drafter"] = 0.0
    elif damage == "no devices":
        s["devices"] = None
        s["config"]["train"] = None
    elif damage == "cpu only":
        s["devices"] = [{"device": "cpu", "roles": ["target", "drafter"]}]
    elif damage == "accum None":                                          # grad_accum missing: 1 micro-batch a step
        s["config"]["train"]["grad_accum"] = None
        assert suggest(s)["target_s"] == 0.4
        return
    else:
        s["time_split_s"] = [0.4, 0.7]
    assert suggest(s) is None


def test_two_nodes_count_every_gpu_and_name_each_by_its_node(fake_gpus):
    """2 nodes x 2 GPUs: both nodes' cuda:0 are two GPUs (rows named by Placement.device_name, as the distributed
    runtime writes them); the same from the config lists when the summary has no devices."""
    from dflash import config as C
    from dflash.train.placement import resolve
    fake_gpus(2)
    train = {"targets": ["0"], "drafters": ["1", "0", "1"], "rendezvous": {"nnodes": 2}}
    pl = resolve(C.from_dict({"train": train}, "x.yaml").cfg.train)
    s = _with_split(0.3, 0.1, 0.1)
    s["config"]["train"].update(train)
    s["devices"] = [{"device": pl.device_name(r), "roles": ["target" if r < pl.target_ranks else "drafter"],
                     "peak_memory_gb": 10.0 + r, "util_mean": 50.0, "rank": r} for r in range(len(pl.ranks))]
    p = suggest(s)
    assert p["gpus"] == pl.gpu_count == 4 and p["current"] == {"targets": 1, "drafters": 3}
    assert p["suggested"] == {"targets": 2, "drafters": 2} and "on 4 GPUs" in p["sentence"]
    del s["devices"]
    assert suggest(s)["gpus"] == 4 and suggest(s)["current"] == {"targets": 1, "drafters": 3}
    s["config"]["train"]["targets"] = s["config"]["train"]["drafters"] = ["0", "1", "0", "1"]   # co-located
    assert suggest(s)["gpus"] == 4 and suggest(s)["colocated"]
    s["config"]["train"]["rendezvous"] = {"nnodes": 1}                   # one node: cuda:0 and cuda:1 once each
    assert suggest(s)["gpus"] == 2
