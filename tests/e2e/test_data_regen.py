"""Regeneration at scale: engine `openai` against a real `transformers serve` on 127.0.0.1, resumable chunks, shards.

The target is `talking_target` (random weights of a large scale: long, varied greedy turns; wide logit gaps). Its
turns are byte-level junk, often with partial UTF-8 sequences; both engines turn tokens into text the same way
(skip special tokens, replacement characters), so the comparison covers that path too.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.data import good_rows, make_loaded, write_jsonl
from dflash.data.expand import expand
from dflash.data.regen import load_cache
from dflash.errors import UserError

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_thread")
SERVE = Path(sys.executable).with_name("transformers")
needs_serve = pytest.mark.skipif(not SERVE.exists(),
                                 reason="transformers CLI not installed")
REGEN = {"enabled": True, "max_new_tokens": 16, "chunk_size": 4, "device": "cpu", "retries": 2, "backoff_s": 0.2,
         "timeout_s": 30, "concurrency": 2}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`transformers serve <target>` on 127.0.0.1 (offline, CPU, float32, one thread)."""

    def __init__(self, target, port=None):
        self.target, self.port = str(target), port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.proc = None

    def start(self):
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
                   TRANSFORMERS_VERBOSITY="error")
        self.proc = subprocess.Popen([str(SERVE), "serve", self.target, "--host", "127.0.0.1", "--port",
                                     str(self.port), "--device", "cpu", "--dtype", "float32"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                                    start_new_session=True)
        import httpx
        for _ in range(240):
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None, "transformers serve exited"
            time.sleep(0.25)
        raise AssertionError("transformers serve did not come up in 60 s")

    def kill(self):
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def server(talking_target):
    s = Server(talking_target).start()
    yield s
    s.kill()


def cfg(tmp_path, target, src, **regen):
    return make_loaded(tmp_path, target, [{"name": "a", "path": src}], min_supervised_blocks=1,
                       regenerate={**REGEN, **regen})


def texts(cache):
    return {h: [m["content"] for m in e["messages"] if m["role"] == "assistant"] for h, e in load_cache(cache).items()}


@needs_serve
def test_openai_engine_equals_hf_token_for_token(tmp_path, talking_target, server):
    src = write_jsonl(tmp_path / "a.jsonl", good_rows(10))
    hf = expand(cfg(tmp_path, talking_target, src, engine="hf"), tmp_path / "hf", progress=False,
                cache_dir=tmp_path / "c-hf")
    oa = expand(cfg(tmp_path, talking_target, src, engine="openai", servers=[server.url]), tmp_path / "oa",
                progress=False, cache_dir=tmp_path / "c-oa")
    assert hf["regeneration"]["engine"] == "hf" and oa["regeneration"]["engine"] == "openai"
    assert oa["regeneration"]["tokens"] == hf["regeneration"]["tokens"] > 0
    t_hf, t_oa = texts(tmp_path / "c-hf"), texts(tmp_path / "c-oa")
    assert len(t_hf) == 10 and t_hf == t_oa                     # the same turns, conversation by conversation
    assert all(t and t[0].strip() and "variant" not in t[0] for t in t_hf.values())   # really regenerated
    assert oa["content_hash"] == hf["content_hash"] and oa["num_samples"] == hf["num_samples"] == 10


def run_stage(tmp_path, config: dict, *args):
    import yaml
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(config))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "dflash", "data", "--config", str(p), "--no-progress", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def raw_config(tmp_path, target, src, **regen):
    from support.data import target_section
    return {"results_dir": str(tmp_path), "target": target_section(target), "drafter": {"block_size": 4},
            "data": {"builtin_corpus": {"enabled": False}, "holdout": 2, "min_supervised_blocks": 1,
                     "max_length": 256, "bucket_edges": [64, 128, 256], "sources": [{"name": "a", "path": src}],
                     "regenerate": {**REGEN, **regen}}}


def wait_for_chunks(cache: Path, n: int, proc, timeout=120):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if len(list(cache.glob("*/chunk-*.jsonl"))) >= n:
            return
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    raise AssertionError("no chunk written")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, talking_target):
    """The stage's source for the kill tests (40 conversations, 2 held out) and its manifest from one uninterrupted
    run (engine hf, 32 new tokens; the chunk size changes no hash): the hash both resumed stages must reach."""
    root = tmp_path_factory.mktemp("ref")
    src = write_jsonl(root / "a.jsonl", good_rows(40))
    ref = expand(make_loaded(root, talking_target, [{"name": "a", "path": src}], min_supervised_blocks=1, holdout=2,
                             regenerate={**REGEN, "max_new_tokens": 32, "chunk_size": 5}), root / "out", progress=False)
    return src, ref


@needs_serve
def test_server_killed_mid_stage_then_rerun_resumes_to_the_same_hash(tmp_path, talking_target, server, reference):
    """The module's server, killed mid-stage, then started again on its port (for the tests after this one too)."""
    src, ref = reference
    conf = raw_config(tmp_path, talking_target, src, engine="openai", servers=[server.url], max_new_tokens=32,
                      chunk_size=2, concurrency=1)
    try:
        proc = run_stage(tmp_path, conf)
        cache = tmp_path / "data" / "default.regen"
        wait_for_chunks(cache, 1, proc)
        server.kill()
        out, _ = proc.communicate(timeout=120)
    finally:
        server.kill()
    try:
        assert proc.returncode == 1, out
        assert f"regeneration server {server.url}: ConnectError" in out and "retry 2/2" in out, out[-2000:]
        assert f"regeneration server {server.url} still failing after 2 retries" in out.splitlines()[-1], out[-2000:]
        assert not (tmp_path / "data" / "default").exists()               # nothing half-written
        kept = len(load_cache(next(cache.iterdir())))
        assert 2 <= kept < 38
    finally:
        server.start()                                                    # the server is back: rerun
    out, _ = run_stage(tmp_path, conf).communicate(timeout=300)
    m = json.loads((tmp_path / "data" / "default" / "manifest.json").read_text())
    assert m["regeneration"]["cached"] == kept and m["regeneration"]["conversations"] == 38, out
    assert m["content_hash"] == ref["content_hash"]


def test_kill_9_of_the_stage_redoes_at_most_one_chunk(tmp_path, talking_target, reference):
    src, ref = reference
    conf = raw_config(tmp_path, talking_target, src, engine="hf", max_new_tokens=32, chunk_size=2)
    proc = run_stage(tmp_path, conf)
    cache = tmp_path / "data" / "default.regen"
    wait_for_chunks(cache, 2, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(load_cache(next(cache.iterdir())))
    assert done >= 4
    out, _ = run_stage(tmp_path, conf).communicate(timeout=300)
    m = json.loads((tmp_path / "data" / "default" / "manifest.json").read_text())
    assert m["regeneration"]["cached"] == done and m["regeneration"]["conversations"] == 38, out
    # nothing regenerated twice: every finished conversation is in exactly one chunk file
    hashes = [json.loads(line)["hash"] for f in next(cache.iterdir()).glob("chunk-*.jsonl")
              for line in f.read_text().splitlines()]
    assert len(hashes) == len(set(hashes)) == 38
    assert m["content_hash"] == ref["content_hash"]


def test_openai_engine_needs_servers(tmp_path, talking_target):
    src = write_jsonl(tmp_path / "a.jsonl", good_rows(3))
    with pytest.raises(UserError, match="data.regenerate.servers is empty"):
        expand(cfg(tmp_path, talking_target, src, engine="openai"), tmp_path / "o", progress=False)


def test_snakemake_scatters_into_shards_and_gathers(tmp_path):
    import yaml
    from support.workflow import copy_repo, snakemake
    conf = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    conf["data"] = {"shards": 3, "regenerate": {"device": "cuda:0"}}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(conf))
    # planned for a cluster (this CPU machine has no cuda:0: a local plan is refused, naming the key)
    r = snakemake(copy_repo(tmp_path / "wf"), "-n", "-p", "--cores", "2", "--resources", "gpu=1", "--workflow-profile",
                  "workflow/profiles/slurm", "--configfile", str(tmp_path / "s.yaml"))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert out.count("rule data_part:") == 3 and "rule data:" in out
    for i in range(3):
        assert f"--shard {i}/3" in out and f"logs/data-default/part-{i}.log" in out
    assert "--gather" in out and "part-0-of-3" in out.split("--gather")[1]
    part = out[out.index("rule data_part:"):]
    assert "gpu=1" in part.split("shell:")[0] or "gpu=1" in part.split("python -m")[0]


def test_static_decoder_and_auto_batch_give_the_greedy_turns_of_generate(talking_target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.data.generate import regenerate
    from dflash.data.tokenise import prompt_ids
    tok = AutoTokenizer.from_pretrained(str(talking_target))
    model = AutoModelForCausalLM.from_pretrained(str(talking_target)).eval()
    prompts = [prompt_ids(tok, r["messages"][:1])[k:] for k, r in zip([0, 3, 5, 0, 9, 2, 7], good_rows(7))]
    assert len({len(p) for p in prompts}) == 6                      # left padding differs from row to row
    ref, st = regenerate(model, tok, prompts, 12, batch_size=3, progress=False)
    static, st2 = regenerate(model, tok, prompts, 12, batch_size=3, progress=False, decoder="static")
    auto, st3 = regenerate(model, tok, prompts, 12, batch_size=0, progress=False)
    assert st["decoder"] == st3["decoder"] == "generate" and st2["decoder"] == "static"   # auto on CPU: generate
    assert st2["attn_implementation"] == "grouped_sdpa"               # the static decoder's grouped decode attention
    assert model.config._attn_implementation == "sdpa"                # ... only while it runs
    assert static == ref == auto and st2["tokens"] == st["tokens"] > 7 * 3
    stop = [ref[0][4]]                                              # a token the turns do produce, as the stop token
    cut_g, _ = regenerate(model, tok, prompts, 12, batch_size=3, progress=False, stop_ids=stop)
    cut_s, _ = regenerate(model, tok, prompts, 12, batch_size=3, progress=False, stop_ids=stop, decoder="static")
    assert cut_s == cut_g and len(cut_g[0]) == 4 and any(len(r) < 12 for r in cut_g)
    assert st3["batch_size"] == 32 and st2["batch_size"] == 3          # CPU: no GPU memory to size it from
    # ignore_eos (the benchmarks): exactly max_new_tokens per turn with either decoder, even when the model's own
    # generation_config names a token the turns produce as its EOS (transformers fills an unset eos from it)
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = ref[0][4]
    try:
        full = {dec: regenerate(model, tok, prompts, 12, batch_size=3, progress=False, decoder=dec,
                                ignore_eos=True)[0] for dec in ("generate", "static")}
        assert full["generate"] == full["static"] and {len(r) for r in full["static"]} == {12}
    finally:
        model.generation_config.eos_token_id = eos


@pytest.mark.gpu
def test_static_decoder_cuda_graph_gives_the_greedy_turns_of_generate(talking_target):
    """On GPU the decode step is compiled and replayed as a CUDA graph; the turns stay those of `generate`, and a
    second call reuses the decoder (no new graph) even with a different prompt count and stop token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.data import decode
    from dflash.data.generate import regenerate
    from dflash.data.tokenise import prompt_ids
    tok = AutoTokenizer.from_pretrained(str(talking_target))
    model = AutoModelForCausalLM.from_pretrained(str(talking_target)).cuda().eval()
    prompts = [prompt_ids(tok, r["messages"][:1])[k:] for k, r in zip([0, 3, 5, 0, 9, 2, 7, 1], good_rows(8))]
    ref, _ = regenerate(model, tok, prompts, 40, batch_size=4, progress=False, decoder="generate")
    graph, st = regenerate(model, tok, prompts, 40, batch_size=4, progress=False)          # auto on GPU: static
    assert st["decoder"] == "static" and decode._LAST[id(model)].graphs and graph == ref
    dec = decode._LAST[id(model)]
    stop = [ref[0][6]]
    ref2, _ = regenerate(model, tok, prompts[:5], 40, batch_size=4, progress=False, decoder="generate", stop_ids=stop)
    graph2, _ = regenerate(model, tok, prompts[:5], 40, batch_size=4, progress=False, stop_ids=stop)
    assert graph2 == ref2 and len(graph2[0]) == 6 and decode._LAST[id(model)] is dec


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{"attention": "grouped_flex"}, {"attention": "grouped_sdpa"},
                                     {"prefill_rows": 3}, {"prefill_rows": 0},
                                     {"prefill_rows": 3, "compile_prefill": True}, {}])
def test_decoder_options_on_cuda_graphs_give_the_greedy_turns_of_generate(talking_target, options):
    """The options compiled and replayed as CUDA graphs (flex: the compiled kernel, which reads only the listed
    blocks) give `generate`'s turns."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.data import decode
    from dflash.data.generate import regenerate
    from dflash.data.tokenise import prompt_ids
    tok = AutoTokenizer.from_pretrained(str(talking_target))
    model = AutoModelForCausalLM.from_pretrained(str(talking_target)).cuda().eval()
    prompts = [prompt_ids(tok, r["messages"][:1])[k:] for k, r in zip([0, 3, 5, 0, 9, 2, 7, 1], good_rows(8))]
    ref, _ = regenerate(model, tok, prompts, 40, batch_size=4, progress=False, decoder="generate", ignore_eos=True)
    got, st = regenerate(model, tok, prompts, 40, batch_size=4, progress=False, ignore_eos=True,
                         static_options=options)
    assert st["decoder"] == "static" and decode._LAST[id(model)].graphs and got == ref
    decode.release(model)


@pytest.mark.gpu
def test_fit_cache_on_cuda_graphs_gives_the_default_decoders_turns(talking_target):
    """fit_cache under CUDA graphs: a decoder (and graph) per cache length, 384 then 256 slots, the greedy turns of
    the default decoder, which keeps the 384-slot cache for every batch."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.data import decode
    from dflash.data.generate import regenerate
    tok = AutoTokenizer.from_pretrained(str(talking_target))
    model = AutoModelForCausalLM.from_pretrained(str(talking_target)).cuda().eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 300, (n,), generator=g).tolist() for n in (30, 250, 12, 260, 40, 245, 7, 233)]
    ref, _ = regenerate(model, tok, prompts, 40, batch_size=4, progress=False, ignore_eos=True)
    assert decode._LAST[id(model)].L == 384
    got, st = regenerate(model, tok, prompts, 40, batch_size=4, progress=False, ignore_eos=True,
                         static_options={"fit_cache": True})
    assert st["decoder"] == "static" and decode._LAST[id(model)].graphs and decode._LAST[id(model)].L == 256
    assert got == ref
    decode.release(model)


def test_bench_regen_runs_tiny(tmp_path):
    out = tmp_path / "regen.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(REPO / "bench" / "regen.py"), "--tiny", "--out",
                        str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["device"] == "cpu" and rep["torch"] and rep["date"] and rep["config"]["prompts"] == 16
    res = {x["variant"]: x for x in rep["results"]}
    assert set(res) == {"generate-4", "static-4-eager"}
    for x in res.values():
        assert x["tokens"] == 16 * 8 and x["tokens_per_s"] > 0 and x["batch_size"] == 4
    assert rep["best"]["variant"] in res


@needs_serve
def test_a_refused_request_is_one_line_naming_the_server(tmp_path, talking_target, server):
    """transformers serve takes text prompts only: token ids (for vLLM/SGLang) get HTTP 400, not retried."""
    src = write_jsonl(tmp_path / "a.jsonl", good_rows(3))
    with pytest.raises(UserError, match=rf"regeneration server {server.url}: HTTP 400.*not retried.*prompt_ids = True"):
        expand(cfg(tmp_path, talking_target, src, engine="openai", servers=[server.url], prompt_ids=True),
               tmp_path / "o", progress=False, cache_dir=tmp_path / "c")


@pytest.mark.slow
def test_snakemake_runs_two_data_shards_to_the_hash_of_one(tmp_path, talking_target):
    """The real rules: 2 `data_part` jobs (each its log and benchmark, gpu=0 on CPU) and the gather, through
    Snakemake with --resources gpu=0; both shards do work, and the manifest (content hash, per-source counts, with a
    weight of 1.5: a per-row rule) is that of the one-process stage. A gather of an incomplete set of parts fails."""
    import yaml
    from dflash.cli import main
    from support.workflow import copy_repo, snakemake
    src = write_jsonl(tmp_path / "a.jsonl", good_rows(8) + good_rows(2, tag="x"))
    res = tmp_path / "res"
    data = {"builtin_corpus": {"enabled": False}, "holdout": 2, "min_supervised_blocks": 1, "max_length": 256,
            "bucket_edges": [64, 128, 256], "sources": [{"name": "a", "path": src, "weight": 1.5}], "shards": 2,
            "regenerate": {**REGEN, "engine": "hf"}}
    conf = {"results_dir": str(res), "target": {"path": str(talking_target), "build": "none"},
            "drafter": {"block_size": 4}, "data": data}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(conf))
    r = snakemake(copy_repo(tmp_path / "wf"), f"{res}/data/default/manifest.json", "--cores", "2", "--resources", "gpu=0",
                  "--configfile", str(tmp_path / "s.yaml"))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    m = json.loads((res / "data" / "default" / "manifest.json").read_text())
    samples = []
    for i in range(2):
        log = (res / "logs" / "data-default" / f"part-{i}.log").read_text()
        samples.append(int(log.split(f"data part {i}/2: ")[1].split(" samples")[0]))
        assert (res / "benchmarks" / "data-default" / f"part-{i}.jsonl").is_file()
    assert all(samples) and sum(samples) == m["num_samples"]                      # both shards did work
    assert not (res / "data" / "default.parts" / "part-0-of-2").exists()          # temp: removed once gathered
    one = expand(make_loaded(tmp_path / "one", talking_target, data["sources"], min_supervised_blocks=1, holdout=2,
                             regenerate=REGEN), tmp_path / "one" / "out", progress=False)
    assert m["data_shards"] == 2 and m["content_hash"] == one["content_hash"]
    assert m["num_samples"] == one["num_samples"] and m["sources"] == one["sources"]
    part = str(res / "p0")                              # shard 0 again (its turns from the cache): a set of one part
    assert main(["data", "--config", str(tmp_path / "s.yaml"), "--no-progress", "--shard", "0/2", "--out", part]) == 0
    assert main(["data", "--config", str(tmp_path / "s.yaml"), "--no-progress", "--out", str(res / "g"),
                 "--gather", part]) == 1


def test_grouped_decode_attention_equals_transformers_sdpa():
    """The decoder's attention reads each KV head once for its query heads; values equal transformers' sdpa (which
    repeats K and V), with a padding mask, for a decode step; other calls are sdpa itself."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from dflash.data.decode import gqa_attention

    class Mod(torch.nn.Module):
        num_key_value_groups, is_causal = 4, True

    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, 1, 16, generator=g, dtype=torch.float64)     # (B, H, 1, D): one decode step
    k, v = (torch.randn(3, 2, 10, 16, generator=g, dtype=torch.float64) for _ in range(2))    # (B, Hkv, L, D)
    mask = torch.ones(3, 1, 1, 10, dtype=torch.bool)
    mask[0, ..., :4] = False                                           # left padding of row 0
    mask[2, ..., 7:] = False                                           # not yet written cache slots of row 2
    out, _ = gqa_attention(Mod(), q, k, v, mask, scaling=0.25)
    ref, _ = sdpa_attention_forward(Mod(), q, k, v, mask, scaling=0.25)
    assert out.shape == ref.shape == (3, 1, 8, 16)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    # a masked slot does not matter; an unmasked one does
    k2 = k.clone()
    k2[0, :, 2] += 5.0
    torch.testing.assert_close(gqa_attention(Mod(), q, k2, v, mask, scaling=0.25)[0], out, rtol=0, atol=1e-12)
    k2[0, :, 5] += 5.0
    assert not torch.allclose(gqa_attention(Mod(), q, k2, v, mask, scaling=0.25)[0], out)


def test_flex_decode_attention_equals_grouped_attention():
    """The `grouped_flex` decode attention (flex_attention, eager here: the math reference, which reads every block)
    is grouped_sdpa's attention for a decode step with left padding and unwritten slots; other calls are it."""
    import torch

    from dflash.data.decode import KV_BLOCK, flex_decode_attention, gqa_attention

    class Mod(torch.nn.Module):
        num_key_value_groups, is_causal = 4, True

    g = torch.Generator().manual_seed(0)
    L = 2 * KV_BLOCK
    q = torch.randn(3, 8, 1, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(3, 2, L, 16, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.ones(3, 1, 1, L, dtype=torch.bool)
    mask[0, ..., :140] = False                                         # left padding: all of block 0 and more
    mask[2, ..., 100:] = False                                         # unwritten slots: all of block 1
    out, _ = flex_decode_attention(Mod(), q, k, v, mask, scaling=0.25)
    ref, _ = gqa_attention(Mod(), q, k, v, mask, scaling=0.25)
    assert out.shape == ref.shape == (3, 1, 8, 16)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    q4 = torch.randn(3, 8, 4, 16, generator=g, dtype=torch.float64)   # a prefill: grouped_sdpa's own path
    pmask = mask.expand(3, 1, 4, L)
    torch.testing.assert_close(flex_decode_attention(Mod(), q4, k, v, pmask, scaling=0.25)[0],
                               gqa_attention(Mod(), q4, k, v, pmask, scaling=0.25)[0], rtol=0, atol=0)


def test_flex_decode_mask_is_the_decoders_own_mask():
    """decoder_mask: a decode step's (one query) bool 2D mask comes back as a (B, 1, 1, L) view of itself (a graph
    input for flex's mask_mod, nothing computed); a prefill's, or a long mask, is sdpa_mask's causal and padding
    mask."""
    import torch
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    from dflash.data.decode import decoder_mask
    m = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    step = decoder_mask(2, 1, 4, attention_mask=m, mask_function=causal_mask_function, allow_is_causal_skip=False)
    assert step.shape == (2, 1, 1, 4) and step.data_ptr() == m.data_ptr() and torch.equal(step[:, 0, 0], m)
    kw = dict(mask_function=causal_mask_function, allow_is_causal_skip=False)
    for q, mask in ((3, m), (1, m.long())):
        want = sdpa_mask(batch_size=2, q_length=q, kv_length=4, attention_mask=mask.bool(), **kw)
        assert torch.equal(decoder_mask(2, q, 4, attention_mask=mask.bool() if q > 1 else mask, **kw), want)


def test_visible_blocks_lists_only_the_kv_blocks_a_decode_step_sees():
    """The block lists a compiled flex kernel reads (eager flex ignores them): per row the 128-slot blocks holding a
    visible slot, in order, and nothing else; those wholly visible as full blocks, the others cut by the mask."""
    import torch

    from dflash.data.decode import KV_BLOCK, visible_blocks
    from dflash.model.masks import block_mask_to_dense
    L = 6 * KV_BLOCK
    vis = torch.zeros(3, L, dtype=torch.bool)
    vis[0, 300:700] = True                           # left padding, the prompt and tokens so far, unwritten slots
    vis[1, :6] = True
    vis[2, 100:130] = True
    vis[2, 640] = True
    bm = visible_blocks(vis)
    def lists(num, idx):
        return [idx[b, 0, 0, :n].tolist() for b, n in enumerate(num[:, 0, 0].tolist())]
    assert lists(bm.kv_num_blocks, bm.kv_indices) == [[2, 5], [0], [0, 1, 5]] and bm.seq_lengths == (1, L)
    assert lists(bm.full_kv_num_blocks, bm.full_kv_indices) == [[3, 4], [], []]
    assert torch.equal(block_mask_to_dense(bm, 1, L)[:, 0], vis)


def test_decoder_options_give_the_default_decoders_greedy_turns(talking_target):
    """The static decoder's options (flex decode attention, the prefill in row chunks of other sizes or the whole
    batch at once, flex with row chunks) give the greedy turns of the default decoder (fp32, CPU) for prompts of six
    lengths in batches of 3; a kept decoder is reused only with the same options."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.data import decode
    from dflash.data.generate import regenerate
    from dflash.data.tokenise import prompt_ids
    tok = AutoTokenizer.from_pretrained(str(talking_target))
    model = AutoModelForCausalLM.from_pretrained(str(talking_target)).eval()
    prompts = [prompt_ids(tok, r["messages"][:1])[k:] for k, r in zip([0, 3, 5, 0, 9, 2, 7], good_rows(7))]
    ref, _ = regenerate(model, tok, prompts, 12, batch_size=3, progress=False, decoder="static", ignore_eos=True)
    assert decode.OPTIONS["prefill_rows"] == decode.PREFILL_ROWS > 0
    for options in ({"prefill_rows": 2}, {"prefill_rows": 0}, {"attention": decode.FLEX},
                    {"attention": decode.FLEX, "prefill_rows": 1}):
        got, st = regenerate(model, tok, prompts, 12, batch_size=3, progress=False, decoder="static",
                             ignore_eos=True, static_options=options)
        assert got == ref, options
        assert decode._LAST[id(model)].options == {**decode.OPTIONS, **options}
        assert st["attn_implementation"] == options.get("attention", decode.GQA)
    assert model.config._attn_implementation == "sdpa"
    d = decode.decoder_for(model, 3, 40, compile=False, prefill_rows=2)
    assert decode.decoder_for(model, 3, 40, compile=False, prefill_rows=2) is d
    assert decode.decoder_for(model, 3, 40, compile=False) is not d and d.cache is None
    d = decode.decoder_for(model, 3, 40, compile=False, compile_prefill=True)            # eager: nothing compiled
    assert decode.decoder_for(model, 3, 40, compile=True, compile_prefill=True) is not d  # its prefill compiled
    d = decode.decoder_for(model, 3, 40, compile=True)                                     # on the CPU: as eager
    assert decode.decoder_for(model, 3, 40, compile=False) is d
    assert not d.prefill_compiled and decode.OPTIONS["compile_prefill"] == decode.AUTO    # auto: eager on the CPU
    decode.release(model)
    cpu, cuda = torch.device("cpu"), torch.device("cuda:0")
    auto, on, off = ({**decode.OPTIONS, "compile_prefill": v} for v in (decode.AUTO, True, False))
    assert [decode.StaticDecoder.compiles_prefill(c, dev, o) for c, dev, o in
            ((True, cuda, auto), (True, cpu, auto), (False, cuda, auto), (True, cpu, on), (False, cpu, on),
             (True, cuda, off))] == [True, False, False, True, False, False]
    for bad in ({"prefill": 2}, {"compile_prefill": "yes"}, {"fit_cache": None}):
        with pytest.raises(ValueError, match="options"):
            decode.StaticDecoder(model, 3, 256, compile=False, **bad)


@pytest.mark.slow
def test_compiled_prefill_is_one_dynamic_graph_with_the_eager_prefills_turns(talking_target):
    """compile_prefill: every row chunk (2 rows, four widths) runs one Inductor graph compiled with dynamic shapes,
    and the greedy turns are the eager prefill's (fp32, CPU). (A chunk of one row would add a graph: dynamo
    specialises sizes 0 and 1.)"""
    import torch
    import torch._dynamo.utils as dynamo_utils
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.data import decode
    from dflash.data.generate import regenerate
    tok = AutoTokenizer.from_pretrained(str(talking_target))
    model = AutoModelForCausalLM.from_pretrained(str(talking_target)).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 300, (n,), generator=g).tolist() for n in (41, 17, 33, 29, 52, 8, 23, 60)]
    ref, _ = regenerate(model, tok, prompts, 10, batch_size=4, progress=False, decoder="static", ignore_eos=True,
                        static_options={"prefill_rows": 2})
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    try:
        got, _ = regenerate(model, tok, prompts, 10, batch_size=4, progress=False, decoder="static", ignore_eos=True,
                            static_options={"prefill_rows": 2, "compile_prefill": True})
        assert got == ref
        assert dynamo_utils.counters["stats"]["unique_graphs"] == 1 and not dynamo_utils.counters["graph_break"]
    finally:
        decode.release(model)
        torch._dynamo.reset()


def test_regenerate_attention_key_reaches_the_static_decoder(talking_target):
    """data.regenerate.attention (the data stage's hf engine) picks the static decoder's decode attention: the flex
    and the grouped sdpa decoders give the same greedy turns (fp32, CPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.config import from_dict
    from dflash.data import decode
    from dflash.data.regen import HFEngine
    from dflash.data.tokenise import prompt_ids
    tok = AutoTokenizer.from_pretrained(str(talking_target))
    model = AutoModelForCausalLM.from_pretrained(str(talking_target)).eval()
    prompts = [(i, prompt_ids(tok, r["messages"][:1])) for i, r in enumerate(good_rows(5))]
    out = {}
    for attention in ("grouped_flex", "grouped_sdpa"):
        rcfg = from_dict({"data": {"regenerate": {"decoder": "static", "compile": False, "batch_size": 3,
                                                  "max_new_tokens": 10, "attention": attention}}}).cfg.data.regenerate
        out[attention] = HFEngine(model, tok, rcfg).generate(prompts, seed=0)
        assert decode._LAST[id(model)].attn == attention
        assert decode._LAST[id(model)].options["compile_prefill"] == decode.AUTO     # the key left null
        decode.release(model)
    assert out["grouped_flex"] == out["grouped_sdpa"] and any(out["grouped_flex"])
    rcfg = from_dict({"data": {"regenerate": {"decoder": "static", "compile": False, "batch_size": 3,
                                              "max_new_tokens": 10, "compile_prefill": False}}}).cfg.data.regenerate
    assert HFEngine(model, tok, rcfg).generate(prompts, seed=0) == out["grouped_sdpa"]
    assert decode._LAST[id(model)].options["compile_prefill"] is False                # data.regenerate.compile_prefill
    decode.release(model)


def test_auto_attention_is_flex_under_cuda_graphs_with_a_power_of_two_head_dim():
    from types import SimpleNamespace

    from dflash.data import decode
    pick = decode.StaticDecoder.attention_for
    qwen = SimpleNamespace(head_dim=128, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8)
    odd = SimpleNamespace(head_dim=None, hidden_size=96, num_attention_heads=1)          # head dim 96
    code = SimpleNamespace(head_dim=64, hidden_size=768, num_attention_heads=12, num_key_value_heads=4)  # 3 a group
    assert decode.OPTIONS["attention"] == decode.AUTO
    assert pick(qwen, decode.AUTO, graphs=True) == decode.FLEX
    assert pick(qwen, decode.AUTO, graphs=False) == decode.GQA                           # CPU or eager
    assert pick(odd, decode.AUTO, graphs=True) == decode.GQA
    assert pick(code, decode.AUTO, graphs=True) == decode.GQA     # Inductor's flex decoding: groups of 2^k only
    assert pick(qwen, decode.GQA, graphs=True) == decode.GQA                             # asked for: kept
    assert pick(odd, decode.FLEX, graphs=False) == decode.FLEX                           # eager: any shape
    with pytest.raises(ValueError, match="head dim 64, 3 query heads per KV head: use grouped_sdpa"):
        pick(code, decode.FLEX, graphs=True)


def test_flex_decode_step_is_one_graph_for_dynamo(talking_target):
    """The flex decode step compiled as on a GPU (fullgraph; dynamo's eager backend here, no Inductor): one graph,
    no graph break, its BlockMask built inside it, and the default decoder's turns."""
    import torch
    import torch._dynamo
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.data import decode
    from dflash.data.generate import _left_padded, regenerate
    from dflash.data.tokenise import prompt_ids
    tok = AutoTokenizer.from_pretrained(str(talking_target))
    model = AutoModelForCausalLM.from_pretrained(str(talking_target)).eval()
    prompts = [prompt_ids(tok, r["messages"][:1])[k:] for k, r in zip([0, 3, 5, 0], good_rows(4))]
    ref, _ = regenerate(model, tok, prompts, 8, batch_size=4, progress=False, decoder="static", ignore_eos=True)
    decode.release(model)
    dec = decode.StaticDecoder(model, 4, 256, compile=False, attention=decode.FLEX)
    dec._greedy = torch.compile(decode._step_greedy, backend="eager", fullgraph=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    ids, att = _left_padded(prompts, range(4), tok.pad_token_id)
    assert dec.generate(ids, att, 8).tolist() == ref
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]
    dec.close()


@pytest.mark.slow
def test_flex_decode_step_compiles_with_inductor_on_the_cpu(talking_target):
    """The flex decode step through Inductor (CPU codegen) gives the default decoder's turns. Before the decoder's own
    mask was read as a graph input (decoder_mask), Inductor refused it here ("All the buffers in the score and mask
    subgraph should be in kernel_group.args.input_buffers": the mask's computation inlined into the mask_mod), as it
    failed on the H200 (r7, `XBLOCK is not defined` in the same mask_mod)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.data import decode
    from dflash.data.generate import _left_padded, regenerate
    tok = AutoTokenizer.from_pretrained(str(talking_target))
    model = AutoModelForCausalLM.from_pretrained(str(talking_target)).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 300, (n,), generator=g).tolist() for n in (30, 12, 40, 7)]
    ref, _ = regenerate(model, tok, prompts, 8, batch_size=4, progress=False, decoder="static", ignore_eos=True)
    decode.release(model)
    dec = decode.StaticDecoder(model, 4, 256, compile=False, attention=decode.FLEX)
    dec._greedy = torch.compile(decode._step_greedy, fullgraph=True)          # Inductor, as on a GPU
    ids, att = _left_padded(prompts, range(4), tok.pad_token_id)
    assert dec.generate(ids, att, 8).tolist() == ref
    dec.close()


def test_static_decoder_is_reused_while_it_fits_and_its_cache_freed_when_replaced(talking_target):
    from transformers import AutoModelForCausalLM

    from dflash.data import decode
    model = AutoModelForCausalLM.from_pretrained(str(talking_target)).eval()
    d1 = decode.decoder_for(model, 3, 40, compile=False)
    assert (d1.B, d1.L) == (3, 256) and d1.cache is not None
    assert decode.decoder_for(model, None, 200, compile=False) is d1          # any batch, fits: reused
    assert decode.decoder_for(model, 3, 256, compile=False) is d1
    d2 = decode.decoder_for(model, 3, 300, compile=False)                     # longer: a new one (384)
    assert d2 is not d1 and d2.L == 384 and d1.cache is None                  # the old cache freed at once
    assert decode.decoder_for(model, None, 10 ** 4, compile=False) is None    # nothing fits, no batch size given
    assert id(model) not in decode._LAST and d2.cache is None


def test_fit_cache_sizes_the_cache_to_each_batch_and_keeps_the_greedy_turns(talking_target, monkeypatch):
    """fit_cache: the prompts sorted longest first, the first batch gets a 384-slot cache, the shorter ones 256 (a new
    decoder, the old cache freed), and the greedy turns are the default decoder's, which keeps 384 for every batch."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.data import decode
    from dflash.data.generate import regenerate
    tok = AutoTokenizer.from_pretrained(str(talking_target))
    model = AutoModelForCausalLM.from_pretrained(str(talking_target)).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 300, (n,), generator=g).tolist() for n in (30, 250, 12, 260, 40, 245)]
    lengths = []
    real = decode.StaticDecoder._generate
    monkeypatch.setattr(decode.StaticDecoder, "_generate", lambda self, *a: lengths.append(self.L) or real(self, *a))
    ref, _ = regenerate(model, tok, prompts, 12, batch_size=3, progress=False, decoder="static", ignore_eos=True)
    assert lengths == [384, 384]                             # the default: the first batch's cache for every batch
    lengths.clear()
    got, _ = regenerate(model, tok, prompts, 12, batch_size=3, progress=False, decoder="static", ignore_eos=True,
                        static_options={"fit_cache": True})
    assert lengths == [384, 256] and got == ref              # 260 + 12 -> 384; 40 + 12 -> 256
    last = decode._LAST[id(model)]
    assert last.L == 256 and decode.decoder_for(model, 3, 250, compile=False, fit_cache=True) is last   # 256 fits
    assert decode.decoder_for(model, 3, 40, compile=False, fit_cache=True) is last
    assert decode.decoder_for(model, 3, 300, compile=False, fit_cache=True).L == 384 and last.cache is None
    decode.release(model)
    with pytest.raises(ValueError, match="fit_cache"):
        decode.StaticDecoder(model, 3, 256, compile=False, fit_cache=1)


def test_default_decoder_on_a_sliding_window_target_prefills_the_whole_batch():
    """A sliding-window cache layer keeps its own slots, so the default row-chunked prefill steps aside there: the
    whole batch is prefilled at once and the greedy turns are `generate`'s (a random 2-layer Qwen3, one layer with a
    6-token window, left padding)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from dflash.data import decode
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, layer_types=["sliding_attention", "full_attention"],
                      sliding_window=6, use_sliding_window=True, max_window_layers=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    dec = decode.StaticDecoder(model, 3, 64, compile=False)
    assert dec.options["prefill_rows"] == decode.PREFILL_ROWS and dec.cache.layers[0].is_sliding
    ids = torch.randint(1, 64, (3, 10))
    att = torch.ones(3, 10, dtype=torch.long)
    att[0, :4] = att[1, :2] = 0
    ref = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert torch.equal(dec.generate(ids, att, 12), ref[:, 10:])
    # the flex decode: its own mask for the full layer (128 slots, one KV block), sdpa_mask's window for the sliding one
    flex = decode.StaticDecoder(model, 3, 128, compile=False, attention=decode.FLEX)
    assert torch.equal(flex.generate(ids, att, 12), ref[:, 10:])
