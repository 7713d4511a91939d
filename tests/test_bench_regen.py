"""bench/regen.py's `hfstatic` variants on the CPU (issue 28): transformers' static-cache `generate` over the prompts,
batches and cache length of our static decoder gives its greedy tokens, eager, with generate's own compile of the
decode step (traced whole by dynamo with the eager backend: no graph break, one graph for all batches) and with the
documented `model.forward = torch.compile(...)` recipe (its compile swapped for an eager-backend one)."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from conftest_data import one_thread  # noqa: F401

REPO = Path(__file__).resolve().parent.parent
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
