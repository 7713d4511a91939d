"""bench/regen.py's `hfstatic` variants on the CPU (issue 28): transformers' static-cache `generate` over the prompts,
batches and cache length of our static decoder gives its greedy tokens, eager, with generate's own compile of the
decode step (traced whole by dynamo with the eager backend: no graph break, one graph for all batches) and with the
documented `model.forward = torch.compile(...)` recipe (its compile swapped for an eager-backend one)."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch


REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_regen", REPO / "bench" / "regen.py")
regen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(regen)
pytestmark = pytest.mark.usefixtures("one_thread")


def test_variant_names():
    assert regen.parse_variant("hfstatic-512") == {"name": "hfstatic-512", "kind": "hfstatic", "batch": 512,
                                                   "gqa": False, "compile": "generate"}
    v = regen.parse_variant("hfstatic-8-forward-gqa")
    assert (v["compile"], v["gqa"]) == ("forward", True)
    assert regen.parse_variant("hfstatic-8-eager")["compile"] == "eager"
    for bad in ("hfstatic", "hfstatic-auto", "hfstatic-8-eager-forward", "hfstatic-8-gqa-gqa", "hfstatic-8-x"):
        with pytest.raises(SystemExit):
            regen.parse_variant(bad)


@pytest.mark.slow   # out of make test-fast: its heavy check runs in make test
def test_hfstatic_gives_the_static_decoders_greedy_tokens(tmp_path, monkeypatch):
    """16 prompts of 3 lengths x 8 tokens, batch 4 (the last batches filled): every hfstatic variant's sequences
    equal static-4-eager's, exactly 8 tokens each (EOS ignored, though the target's generation_config has one)."""
    real, compiled = torch.compile, []

    def eager_compile(fn=None, **kw):                      # the -forward recipe, minus Inductor's CPU compile time
        compiled.append((fn.__name__, kw))
        return real(fn, backend="eager", fullgraph=True)
    monkeypatch.setattr(torch, "compile", eager_compile)
    out = tmp_path / "regen.json"
    assert regen.main(["--tiny", "--out", str(out), "--variants",
                       "static-4-eager,hfstatic-4-eager,hfstatic-4-eager-gqa,hfstatic-4-forward,generate-4"]) == 0
    res = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert compiled == [("forward", {"mode": "reduce-overhead", "fullgraph": True})]     # once, for -forward
    assert "greedy_vs" not in res["static-4-eager"]                 # the reference
    for name in ("hfstatic-4-eager", "hfstatic-4-eager-gqa", "hfstatic-4-forward", "generate-4"):
        r = res[name]
        assert "error" not in r, r
        assert r["tokens"] == 16 * 8 and r["batch_size"] == 4 and r["tokens_per_s"] > 0 and r["warmup_s"] > 0
        assert r["greedy_vs"] == {"variant": "static-4-eager", "identical_sequences": 16, "sequences": 16,
                                  "mean_common_prefix": 8.0}, name
    assert res["hfstatic-4-eager"]["attn_implementation"] == "sdpa"
    assert res["hfstatic-4-eager-gqa"]["attn_implementation"] == "grouped_sdpa"


@pytest.mark.parametrize("gqa", [False, True])
def test_generates_own_compile_is_one_graph_with_a_static_cache(tmp_path, monkeypatch, gqa):
    """The plain hfstatic variant on a GPU: generate compiles its decode step (CompileConfig, fullgraph). Here with
    dynamo's eager backend on the CPU (`_compile_all_devices`): the compiled call is used, the cache is transformers'
    StaticCache of the decoder's length, dynamo makes one graph for both batch widths and both calls (a warm-up
    with fewer tokens, then the timed one: the same cache length, so no recompile), no graph break, and the
    tokens are those of our static decoder (regenerate, decoder static)."""
    import torch._dynamo
    from transformers import CompileConfig
    from transformers.generation.utils import GenerationMixin

    from dflash.data.decode import GQA, _register, release
    from dflash.data.generate import regenerate
    model, tok = regen.build(regen.TINY, "cpu", "float32", tmp_path / "target")
    prompts = regen.make_prompts(tok, regen.TINY["vocab_size"], 7, [8, 12, 16])
    ours, _ = regenerate(model, tok, prompts, 6, 0.0, 4, progress=False, decoder="static", compile=False,
                         ignore_eos=True)
    release(model)
    caches = []
    prepare = GenerationMixin._prepare_static_cache

    def spy(self, *a, **kw):
        caches.append(prepare(self, *a, **kw))
        return caches[-1]
    monkeypatch.setattr(GenerationMixin, "_prepare_static_cache", spy)
    if gqa:
        _register()
        model.set_attn_implementation(GQA)
    cfg = CompileConfig(fullgraph=True, backend="eager")
    cfg._compile_all_devices = True
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    regen.hf_static(model, prompts, 3, 4, tok.pad_token_id, "generate", 256, compile_config=cfg)    # the warm-up
    tokens, seqs = regen.hf_static(model, prompts, 6, 4, tok.pad_token_id, "generate", 256, compile_config=cfg)
    assert hasattr(model, "_compiled_call")
    assert tokens == 7 * 6 and seqs == ours
    assert len(caches) == 4 and all(type(c).__name__ == "StaticCache" and c.max_cache_len == 256 for c in caches)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]


def test_static_variant_names():
    assert regen.parse_variant("static-512") == {"name": "static-512", "kind": "generate", "decoder": "static",
                                                 "batch": 512, "compile": True, "options": {},
                                                 "inductor": {}}
    v = regen.parse_variant("static-512-prefill64-flex")
    assert (v["batch"], v["compile"], v["options"]) == (512, True, {"prefill_rows": 64, "attention": "grouped_flex"})
    v = regen.parse_variant("static-auto-eager-flex")
    assert (v["batch"], v["compile"], v["options"]) == (0, False, {"attention": "grouped_flex"})
    assert regen.parse_variant("generate-4-eager")["options"] == {}
    assert regen.parse_variant("static-512-prefill0")["options"] == {"prefill_rows": 0}    # the pre-r7 decoder
    v = regen.parse_variant("static-512-flex-noprologue")
    assert v["inductor"] == {"prologue_fusion": False} and v["options"] == {"attention": "grouped_flex"}
    assert regen.parse_variant("static-512")["inductor"] == {}
    assert regen.parse_variant("static-512-fit")["options"] == {"fit_cache": True}
    assert regen.parse_variant("static-512-sdpa-fit")["options"] == {"attention": "grouped_sdpa", "fit_cache": True}
    assert regen.parse_variant("static-512-cprefill")["options"] == {"compile_prefill": True}
    assert regen.parse_variant("static-512-eprefill")["options"] == {"compile_prefill": False}   # before 2026-12-03
    for bad in ("static-4-prefill", "static-4-flex-flex", "static-4-flex-sdpa", "generate-4-sdpa",
                "generate-4-cprefill", "static-4-eager-cprefill",
                "static-4-prefill0-cprefill", "static-4-cprefill-eprefill", "static-4-eprefill-eprefill",
                "generate-4-flex", "static-x",
                "static-4-prefill2-prefill3", "static", "generate-4-noprologue",
                "static-4-noprologue-noprologue", "static-4-fit-fit", "generate-4-fit"):
        with pytest.raises(SystemExit):
            regen.parse_variant(bad)


def test_fit_variant_times_every_batchs_decoder(tmp_path):
    """-fit: prompts of 250 and 8 tokens at batch 4 (sorted: two batches of each width) get caches of 384 and 256
    slots, a decoder each; the phases count every batch of both decoders, and the greedy tokens are the reference's."""
    from dflash.data import decode
    generate = decode.StaticDecoder.generate
    out = tmp_path / "regen.json"
    assert regen.main(["--tiny", "--out", str(out), "--variants", "static-4-eager,static-4-eager-fit",
                       "--prompt-lengths", "250,8"]) == 0
    assert decode.StaticDecoder.generate is generate                     # the clock's hook undone
    kept = [d for d in decode._LAST.values() if d.cache is not None]
    assert kept and all(d._greedy is decode._step_greedy for d in kept)  # ... and each decoder's step unwrapped
    res = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    fit = res["static-4-eager-fit"]
    assert fit["options"] == {"fit_cache": True} and fit["greedy_vs"]["identical_sequences"] == 16
    for r in res.values():
        assert (r["phases"]["calls"], r["phases"]["decode_steps"]) == (4, 4 * 7) and r["tokens"] == 16 * 8


def test_phases_and_profile_of_the_static_decoder(tmp_path):
    """Every static variant reports its prefill, decode step and between-steps time; --profile adds a torch.profiler
    table of one batch with 3 decode steps: on the CPU the ops' self times, the decode step's (argmax, attention,
    matmuls) apart from the prefill's. The options' variant keeps the reference's greedy tokens."""
    import gzip
    out = tmp_path / "regen.json"
    with pytest.raises(SystemExit):                                         # not a listed variant
        regen.main(["--tiny", "--out", str(out), "--variants", "static-4-eager", "--profile", "static-8-eager"])
    assert regen.main(["--tiny", "--out", str(out), "--variants",
                       "static-4-eager,static-4-eager-prefill2-flex-noprologue,generate-4",
                       "--profile", "static-4-eager,generate-4", "--profile-steps", "3"]) == 0
    res = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    for name in ("static-4-eager", "static-4-eager-prefill2-flex-noprologue"):
        ph = res[name]["phases"]
        assert (ph["calls"], ph["decode_steps"]) == (4, 4 * 7), name              # 16 prompts / 4, 8 tokens each
        assert ph["prefill_ms"] > 0 and ph["decode_step_ms"] > 0 and ph["between_steps_ms"] > 0
        assert 0 < ph["prefill_share"] < 1
        assert ph["decode_tokens_per_s"] == pytest.approx(4e3 / (ph["decode_step_ms"] + ph["between_steps_ms"]),
                                                          rel=1e-2)
    assert res["static-4-eager-prefill2-flex-noprologue"]["greedy_vs"]["identical_sequences"] == 16
    assert res["static-4-eager-prefill2-flex-noprologue"]["options"] == {"prefill_rows": 2, "attention": "grouped_flex"}
    assert "phases" not in res["generate-4"] and "error" in res["generate-4"]["profile"]
    prof = res["static-4-eager"]["profile"]
    t = prof["table"]
    assert (t["device"], t["steps"], prof["steps_asked"]) == ("cpu", 3, 3)
    step, outside = t["step"], t["outside"]
    for part in (step, outside):
        assert sum(g["share"] for g in part["groups"].values()) == pytest.approx(1, abs=2e-3)
        assert sum(g["ms"] for g in part["groups"].values()) == pytest.approx(part["ms"], rel=1e-2)
        assert {"gemm", "attention", "elementwise+copies"} <= set(part["groups"])
    assert step["groups"]["sampling"]["ms"] > 0                          # the step's argmax
    assert step["ms"] > 0 and outside["groups"]["gemm"]["ms"] > 0                # the prefill's matmuls
    with gzip.open(tmp_path / prof["trace_file"], "rt") as f:
        assert sum(e.get("name") == "decode_step" for e in json.load(f)["traceEvents"]) == 3
    from bench.traces import step_table
    top = {x["name"]: x for x in step_table(tmp_path / prof["trace_file"], "decode_step", top=1000)["step"]["top"]}
    assert top["aten::mm"]["group"] == "gemm" and top["aten::mm"]["count"] == 2 * 7 + 1   # 2 layers x 7 Linear + head


def test_step_table_gives_a_step_the_kernels_its_launches_made(tmp_path):
    """On a GPU trace a kernel is the step's when the runtime call that launched it (same correlation id) lies in
    a decode_step range, however late it runs; kernels launched elsewhere (the prefill) are `outside`."""
    import gzip

    from bench.traces import group, step_table

    def x(cat, name, ts, dur, tid=1, corr=None):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid,
                "pid": 0 if cat.startswith(("kernel", "gpu")) else 1,
                **({"args": {"correlation": corr}} if corr is not None else {})}
    ev = [x("user_annotation", "decode_step", 100, 100), x("user_annotation", "decode_step", 300, 100),
          x("cuda_runtime", "cudaLaunchKernel", 50, 5, corr=3), x("cuda_runtime", "cudaGraphLaunch", 150, 10, corr=7),
          x("cuda_runtime", "cudaGraphLaunch", 350, 10, corr=8)]
    for corr, t0 in ((7, 1000), (8, 9000)):                              # a graph's kernels run long after the launch
        ev += [x("kernel", "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", t0, 30, tid=7, corr=corr),
               x("kernel", "fmha_cutlassF_bf16_aligned_64x64_rf_sm80", t0 + 30, 50, tid=7, corr=corr),
               x("kernel", "triton_red_fused_argmax_0", t0 + 80, 5, tid=7, corr=corr),
               x("gpu_memcpy", "Memcpy DtoD (Device -> Device)", t0 + 85, 10, tid=7, corr=corr)]
    ev.append(x("kernel", "sm90_xmma_gemm_bf16bf16_bf16f32", 60, 1000, tid=7, corr=3))
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    t = step_table(path, "decode_step")
    assert (t["device"], t["steps"]) == ("gpu", 2)
    assert t["step"]["ms"] == pytest.approx(0.095)
    assert {g: v["ms"] for g, v in t["step"]["groups"].items()} == pytest.approx(
        {"attention": 0.05, "gemm": 0.03, "elementwise+copies": 0.01, "sampling": 0.005})
    assert t["step"]["groups"]["attention"]["share"] == pytest.approx(50 / 95, abs=1e-4)
    assert t["step"]["top"][0] == {"name": "fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "group": "attention",
                                   "count": 1.0, "ms": 0.05, "share": pytest.approx(50 / 95, abs=1e-4)}
    assert t["outside"]["ms"] == 1.0 and t["outside"]["groups"] == {"gemm": {"ms": 1.0, "share": 1.0}}
    names = ("aten::mm", "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::argmax", "aten::index_copy_",
             "triton_poi_fused_add_cos_mul_neg_sin_0", "triton_tem_fused_flex_decoding_0", "Torch-Compiled Region: 0/0")
    assert [group(n) for n in names] == \
        ["gemm", "attention", "sampling", "elementwise+copies", "elementwise+copies", "attention", "other"]
    fp8 = ("triton_red_fused__to_copy_abs_amax_clamp_div_0",          # kernel names of the H200's fp8all profile
           "triton_red_fused_abs_max_mul_silu_silu_backward_view_4",
           "triton_poi_fused__scaled_mm__to_copy_clamp_clone_mul_reciprocal_silu_silu_backward_t_view_6",
           "nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_ovscale_TNT", "triton_poi_fused__to_copy_t_12")
    assert [group(n) for n in fp8] == ["fp8 scale+cast"] * 3 + ["gemm", "elementwise+copies"]


def test_a_failed_profile_keeps_the_variants_timed_pass(tmp_path, monkeypatch):
    """The profile (torch.profiler on CUDA graphs, first run on the device) and the phases come after the timed pass:
    their failure is recorded under their own key, and the variant keeps its tokens/s and its greedy sequences (the
    reference of every other variant's greedy_vs)."""
    def boom(*a, **kw):
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")
    monkeypatch.setattr(regen, "profile_decode", boom)
    monkeypatch.setattr(regen.PhaseClock, "summary", boom)
    out = tmp_path / "regen.json"
    assert regen.main(["--tiny", "--out", str(out), "--variants", "static-4-eager,generate-4",
                       "--profile", "static-4-eager"]) == 0
    res = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    ref = res["static-4-eager"]
    assert ref["tokens_per_s"] > 0 and "error" not in ref
    assert ref["profile"] == {"error": "RuntimeError: CUPTI_ERROR_NOT_INITIALIZED"} == ref["phases"]
    assert res["generate-4"]["greedy_vs"]["identical_sequences"] == 16


def test_a_profile_trace_is_kept_only_under_the_size_the_device_returns(tmp_path, monkeypatch):
    """The device brings back files of at most 16 MiB: a gzipped trace at or over bench.traces.KEEP_MB stays out of
    the output folder (its table and size are still reported)."""
    import bench.traces
    assert bench.traces.KEEP_MB <= 16
    monkeypatch.setattr(bench.traces, "KEEP_MB", 0)
    out = tmp_path / "regen.json"
    assert regen.main(["--tiny", "--out", str(out), "--variants", "static-4-eager", "--profile", "static-4-eager",
                       "--profile-steps", "2"]) == 0
    prof = json.loads(out.read_text())["results"][0]["profile"]
    assert prof["trace_mb"] > 0 and "trace_file" not in prof and prof["table"]["steps"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["regen.json"]


def test_step_table_averages_over_the_steps_whose_kernels_it_saw(tmp_path):
    """A step whose kernel records the profiler dropped (torch 2.10's kineto discards those stamped before its window)
    must not halve the per-step figures: they are over the ranges that got work, and the table says how many."""
    import gzip

    from bench.traces import step_table

    def x(cat, name, ts, dur, corr, tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1,
                "args": {"correlation": corr}}
    ev = [{"ph": "X", "cat": "user_annotation", "name": "decode_step", "ts": t, "dur": 100, "tid": 1, "pid": 1}
          for t in (100, 300)]
    ev += [x("cuda_runtime", "cudaGraphLaunch", 150, 10, 7), x("cuda_runtime", "cudaGraphLaunch", 350, 10, 8),
           x("kernel", "nvjet_tst_128x256", 1000, 40, 8, tid=7)]       # the first launch's kernels: dropped
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    t = step_table(path, "decode_step")
    assert (t["steps"], t["steps_with_work"]) == (2, 1) and t["step"]["ms"] == pytest.approx(0.04)
