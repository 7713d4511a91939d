"""Placement: which device each worker (and, in the distributed runtime, each rank and node) gets; GPU-free (torch is
told it has 8 GPUs; nothing runs on them)."""
import pytest

from dflash import config as C
from dflash.errors import UserError
from dflash.train.placement import resolve

TWO_NODES = {"targets": [str(i) for i in range(8)] + [str(i) for i in range(5)], "drafters": ["5", "6", "7"],
             "rendezvous": {"nnodes": 2, "endpoint": "node1:29500", "id": "job"}}   # the README's 2-node recipe


def place(**train):
    return resolve(C.from_dict({"train": train}, "x.yaml").cfg.train)


def test_two_nodes_each_list_their_local_gpus_once(fake_gpus):
    fake_gpus(8)
    for runtime in ("auto", "distributed"):   # auto: several nodes are always the distributed runtime
        p = place(runtime=runtime, **TWO_NODES)
        assert p.runtime == "distributed" and not p.colocated and p.nnodes == 2 and p.per_node == 8
        assert p.target_ranks == 13 and len(p.ranks) == 16
        node0, node1 = ([str(p.ranks[r]) for r in p.node_ranks(n)] for n in (0, 1))
        assert node0 == node1 == [f"cuda:{i}" for i in range(8)]       # every local GPU once on each node
        assert [p.worker(r) for r in p.node_ranks(1)] == \
            ["target-8", "target-9", "target-10", "target-11", "target-12", "drafter-0", "drafter-1", "drafter-2"]
        assert p.role(13) == "drafter-0 (cuda:5)" and p.role(12) == "target-12 (cuda:4)"
    # co-located on 2 nodes: 16 ranks, each with its target and replica; node n runs drafters[8n:8n+8]
    both = [f"cuda:{i % 8}" for i in range(16)]
    p = place(targets=both, drafters=[str(i % 8) for i in range(16)], rendezvous=TWO_NODES["rendezvous"])
    assert p.colocated and p.target_ranks == 0 and p.per_node == 8 and len(p.ranks) == 16
    assert p.role(9) == "drafter-9 + target (cuda:1)"


def test_a_gpu_twice_on_one_node_is_refused_naming_node_and_ranks(fake_gpus):
    fake_gpus(8)
    bad = dict(TWO_NODES, drafters=["5", "6", "4"])        # node 1: cuda:4 runs target-12 and drafter-2
    with pytest.raises(UserError) as e:
        place(**bad)
    msg = str(e.value)
    assert "node 1 runs ranks 8-15" in msg and "cuda:4 holds rank 12 = target-12, rank 15 = drafter-2" in msg
    with pytest.raises(UserError, match="node 0 runs ranks 0-1 .*cuda:0 holds rank 0 = drafter-0 \\+ target, "
                                        "rank 1 = drafter-1 \\+ target"):     # co-located, 2 per node
        place(targets=["0", "0", "0", "1"], drafters=["0", "0", "0", "1"], rendezvous={"nnodes": 2})
    with pytest.raises(UserError, match="the 15 ranks \\(train.targets \\+ train.drafters\\) do not split evenly"):
        place(**dict(TWO_NODES, drafters=["5", "6"]))
    with pytest.raises(UserError, match="train.rendezvous.nnodes is 2: several nodes need train.runtime: distributed"):
        place(**dict(TWO_NODES, runtime="threads"))


def test_one_node_is_unchanged(fake_gpus):
    fake_gpus(8)
    seed = place(targets=["cuda:0", "cuda:1", "cuda:2", "cuda:3", "cuda:4"], drafters=["cuda:5", "cuda:6", "cuda:7"])
    assert seed.runtime == "distributed" and seed.per_node == 8 and seed.role(5) == "drafter-0 (cuda:5)"
    # co-located: distributed only when asked (auto keeps one process for shared GPUs)
    eight = dict(targets=[str(i) for i in range(8)], drafters=[f"cuda:{i}" for i in range(8)])
    assert place(**eight).runtime == "threads" and not place(**eight).colocated
    p = place(runtime="distributed", **eight)
    assert p.colocated and p.per_node == 8 and p.role(3) == "drafter-3 + target (cuda:3)"
    assert place(targets=["0"], drafters=["0"]).runtime == "threads"
    assert place(targets=["0", "0"], drafters=["1"]).runtime == "threads"       # auto: cuda:0 runs two targets
    with pytest.raises(UserError, match="cuda:0 holds rank 0 = target-0, rank 1 = target-1.* use train.runtime: "
                                        "threads for shared GPUs"):
        place(targets=["0", "0"], drafters=["1"], runtime="distributed")
    with pytest.raises(UserError, match="only 8 GPU"):
        place(targets=["8"], drafters=["1"])
    cpu = place(targets=["cpu"], drafters=["cpu", "cpu"], runtime="distributed")   # gloo: CPU ranks may share
    assert cpu.ranks == cpu.targets + cpu.drafters and cpu.per_node == 3


def test_cpu_beside_gpus_is_threads_under_auto_and_refused_distributed(fake_gpus):
    fake_gpus(8)
    assert place(targets=["cpu"], drafters=["0", "1"]).runtime == "threads"          # auto: not every worker on a GPU
    with pytest.raises(UserError, match="mix CPU and GPU devices \\(rank 0 = target-0 on the CPU\\).*use "
                                        "train.runtime: threads"):
        place(targets=["cpu"], drafters=["0", "1"], runtime="distributed")
    with pytest.raises(UserError, match="mix CPU and GPU") as e:                      # several nodes: no threads hint
        place(targets=["cpu", "cpu"], drafters=["0", "0"], rendezvous={"nnodes": 2})
    assert "threads" not in str(e.value)


def test_gpu_count_counts_every_node(fake_gpus):
    fake_gpus(8)
    assert place(runtime="distributed", **TWO_NODES).gpu_count == 16                # 2 x 8, same local names
    both = [str(i % 8) for i in range(16)]
    assert place(targets=both, drafters=both, rendezvous=TWO_NODES["rendezvous"]).gpu_count == 16
    assert place(targets=["0", "0"], drafters=["0", "1"]).gpu_count == 2            # threads: distinct GPUs
    assert place(targets=["cpu"], drafters=["cpu"], runtime="distributed").gpu_count == 0


def test_device_names_tell_the_nodes_apart(fake_gpus):
    fake_gpus(2)   # 2 nodes x 2 GPUs: rank 0 = target-0, ranks 1-3 drafters; each node lists cuda:0, cuda:1
    p = place(targets=["0"], drafters=["1", "0", "1"], rendezvous={"nnodes": 2})
    names = [p.device_name(r) for r in range(len(p.ranks))]
    assert names == ["node0/cuda:0", "node0/cuda:1", "node1/cuda:0", "node1/cuda:1"]
    assert len(set(names)) == p.gpu_count == 4
    one = place(targets=["0"], drafters=["1"], runtime="distributed")              # one node: the plain device
    assert [one.device_name(r) for r in range(2)] == ["cuda:0", "cuda:1"]


def test_warmup_of_a_gpu_the_job_does_not_see_names_the_remedy(fake_gpus, monkeypatch, tmp_path, capsys):
    """A SLURM job given 1 GPU sees it as cuda:0. The Inductor cache key holds the device index, so the warm-up of
    cuda5 must not compile on that GPU instead: it stops, before loading anything, naming why and what to do."""
    import yaml

    from dflash.cli import main
    from dflash.stages.warmup import warmup_device
    seed = {"targets": ["0", "1", "2", "3", "4"], "drafters": ["5", "6", "7"]}
    cfg = C.from_dict({"train": seed}, "x.yaml").cfg.train
    fake_gpus(8)
    assert str(warmup_device("cuda5", cfg)) == "cuda:5" and str(warmup_device("cuda:7", cfg)) == "cuda:7"
    fake_gpus(1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"train": seed}))
    assert main(["warmup", "--config", str(path), "--device", "cuda5"]) == 1
    err = capsys.readouterr().err
    assert "warmup --device cuda5: this job sees 1 GPU(s) (CUDA_VISIBLE_DEVICES=3)" in err
    assert "GPUs up to cuda:7" in err and "keyed by the CUDA device index" in err and "gres: gpu:8" in err
    with pytest.raises(UserError, match="sees 1 GPU.*up to cuda:7"):       # cuda:0 is here, but the placement's GPUs not
        warmup_device("cuda0", cfg)
    one = C.from_dict({"train": {"targets": ["0"], "drafters": ["0"]}}, "x.yaml").cfg.train
    assert str(warmup_device("cuda0", one)) == "cuda:0"
    fake_gpus(0)
    with pytest.raises(UserError, match="sees 0 GPU"):
        warmup_device("cuda0", one)
    assert str(warmup_device("cpu", C.from_dict({"train": {"targets": ["cpu"], "drafters": ["cpu"]}}, "x.yaml").cfg.train)) == "cpu"


def test_compiled_workers_per_process(fake_gpus):
    """What one process compiles for (compile_guard.recompile_limit counts shapes x these): the threads runtime every
    replica and compiled target, the distributed runtime one rank's."""
    fake_gpus(8)
    eight = dict(targets=[str(i) for i in range(8)], drafters=[str(i) for i in range(8)])
    threads = place(runtime="threads", **eight)
    assert threads.compiled_workers(False) == 8 and threads.compiled_workers(True) == 16
    seed = place(targets=["0", "1", "2", "3", "4"], drafters=["5", "6", "7"], runtime="threads")
    assert seed.compiled_workers(False) == 3 and seed.compiled_workers(True) == 8
    coloc = place(runtime="distributed", **eight)
    assert coloc.compiled_workers(False) == 1 and coloc.compiled_workers(True) == 2
    assert place(targets=["0"], drafters=["1"], runtime="distributed").compiled_workers(True) == 1
