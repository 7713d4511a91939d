"""Serving check, the stacks' side: run by .venv-serving (vLLM and SGLang installed from their wheels, no GPU), never
by the project venv.

    VLLM_TARGET_DEVICE=cpu VLLM_USE_V2_MODEL_RUNNER=1 .venv-serving/bin/python tests/serving/check_stacks.py OUT_DIR
reads what tests/serving/make_case.py wrote and, for vLLM's DFlashQwen3ForCausalLM and SGLang's DFlashDraftModel and
each layer layout:
  1. builds the class from our config.json the way the server does (vLLM: SpeculativeConfig(method="dflash") over a
     target ModelConfig, on its CPU platform, with the V2 model runner that mixed layouts need; SGLang: its
     get_config and a published test topology);
  2. fills every parameter with NaN, loads our model.safetensors with the class's own load_weights, and compares
     every parameter with our tensors (q/k/v and gate/up stacked as each stack stacks them): a parameter still NaN is
     missing, a tensor of ours that lands nowhere is unexpected (neither stack reports either);
  3. checks that each layer resolved the attention it was trained with (window, causality);
  4. tries the class's own forward and records why it cannot run here; then runs the forward of the class's own
     modules (fc, norms, q/k/v/o projections, q/k norms, RoPE, MLP), with a plain softmax attention under the mask
     the layer resolved in place of the engine's attention kernel, and compares the block's hidden states with ours.
Writes OUT_DIR/serving.json; exits 1 on any difference.
"""
from __future__ import annotations

import json
import math
import sys
import traceback
from pathlib import Path

import torch

TOL = 1e-4
LOCAL = ("embed_tokens", "lm_head", "mask_embedding")   # the target's, shared at serving time; not exported


def out(r):
    return r[0] if isinstance(r, tuple) else r


def norm(mod, x):
    shape = x.shape
    return out(mod.forward_native(x.reshape(-1, shape[-1]))).reshape(shape)


def stacked(name: str, sd: dict) -> torch.Tensor | None:
    """Our tensor(s) behind a stack's parameter `name` (without its prefix)."""
    for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
        if f".{fused}." in name:
            return torch.cat([sd[name.replace(fused, p)] for p in parts], 0)
    return sd.get(name)


def compare_params(named, sd, prefix, problems, stack):
    used = set()
    for name, p in named:
        short = name.removeprefix(prefix)
        if any(k in short for k in LOCAL):
            continue
        if torch.isnan(p).any():
            problems.append(f"{stack}: parameter {name} was not loaded (missing from our export)")
            continue
        ours = stacked(short, sd)
        if ours is None or ours.shape != p.shape or not torch.equal(ours.to(p.dtype), p.data):
            problems.append(f"{stack}: parameter {name} differs from our tensor(s)")
        for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
            if f".{fused}." in short:
                used |= {short.replace(fused, q) for q in parts}
                break
        else:
            used.add(short)
    for name in sorted(set(sd) - used):
        problems.append(f"{stack}: our tensor {name} landed in no parameter")


def attention(q, k, v, qpos, kpos, causal, window, nh, nkv, hd):
    """Plain softmax attention: q [T, nh*hd], k/v [S, nkv*hd]; key kp visible from query qp when (not causal or
    kp <= qp) and (window is None or qp - kp < window)."""
    q = q.view(-1, nh, hd).transpose(0, 1)
    k = k.view(-1, nkv, hd).transpose(0, 1).repeat_interleave(nh // nkv, 0)
    v = v.view(-1, nkv, hd).transpose(0, 1).repeat_interleave(nh // nkv, 0)
    d = qpos[:, None] - kpos[None, :]
    allowed = torch.ones_like(d, dtype=torch.bool)
    if causal:
        allowed &= d >= 0
    if window is not None:
        allowed &= d < window
    s = (q @ k.transpose(1, 2)) / math.sqrt(hd)
    s = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (s @ v).transpose(0, 1).reshape(q.shape[1], nh * hd)


def modules_forward(model, case, layer_attn):
    """The drafter's forward from the stack's own modules; layer_attn(layer) -> (causal, window incl. the query)."""
    ctx = norm(model.hidden_norm, out(model.fc(case["target_hidden"])))              # [S, H]
    a, B = int(case["anchor"]), case["block_ids"].numel()
    kpos, qpos = torch.arange(a + B), torch.arange(a, a + B)
    h = case["block_embeds"]
    for layer in model.layers:
        at = layer.self_attn
        nh, nkv, hd = at.num_heads, at.num_kv_heads, at.head_dim
        x = norm(layer.input_layernorm, h)
        q, k, v = out(at.qkv_proj(x)).split([nh * hd, nkv * hd, nkv * hd], -1)
        _, kc, vc = out(at.qkv_proj(ctx)).split([nh * hd, nkv * hd, nkv * hd], -1)
        q, k, kc = (norm(at.q_norm, q.reshape(-1, hd)).reshape(q.shape), norm(at.k_norm, k.reshape(-1, hd)).reshape(k.shape),
                    norm(at.k_norm, kc.reshape(-1, hd)).reshape(kc.shape))
        q, k = at.rotary_emb.forward_native(qpos, q, k)
        _, kc = at.rotary_emb.forward_native(kpos[:a], torch.zeros_like(kc.repeat(1, nh // nkv)), kc)
        causal, window = layer_attn(layer)
        y = attention(q, torch.cat([kc, k]), torch.cat([vc, v]), qpos, kpos, causal, window, nh, nkv, hd)
        h = h + out(at.o_proj(y))
        m = layer.mlp
        h = h + out(m.down_proj(m.act_fn.forward_native(out(m.gate_up_proj(norm(layer.post_attention_layernorm, h))))))
    return norm(model.norm, h)


def fill_nan(model):
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.fill_(float("nan"))


def expected_attn(config, i):
    sliding = config["layer_types"][i] == "sliding_attention"
    return (True, config["sliding_window"]) if sliding else (False, None)


def check_vllm(case_dir, target_dir, case, sd, config, problems, report):
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM
    mc = ModelConfig(model=str(target_dir), skip_tokenizer_init=True, dtype="float32")
    pc = ParallelConfig()
    sc = SpeculativeConfig(method="dflash", model=str(case_dir / "drafter"), num_speculative_tokens=len(case["block_ids"]) - 1,
                           target_model_config=mc, target_parallel_config=pc)
    vc = VllmConfig(model_config=mc, parallel_config=pc, speculative_config=sc)
    with set_current_vllm_config(vc):
        _init_vllm_distributed()
        model = DFlashQwen3ForCausalLM(vllm_config=vc).eval()
        fill_nan(model)
        model.load_weights(iter(sd.items()))
        process_weights_after_loading(model, mc, torch.device("cpu"))   # as vLLM's loader does after load_weights
    compare_params(model.named_parameters(), sd, "model.", problems, "vllm")
    got = [(layer.self_attn.causal, layer.self_attn.sliding_window) for layer in model.model.layers]
    want = [expected_attn(config, i) for i in range(len(got))]
    if got != want:
        problems.append(f"vllm: layers resolved (causal, window) {got}, trained {want}")
    report["attention"] = got
    report["own_forward"] = _try(lambda: model.model.precompute_and_store_context_kv(
        model.combine_hidden_states(case["target_hidden"]), torch.arange(int(case["anchor"]))))
    with set_current_vllm_config(vc), torch.no_grad():
        hidden = modules_forward(model.model, case, lambda l: (l.self_attn.causal, l.self_attn.sliding_window))
    report["modules_forward_max_diff"] = float((hidden - case["ours"]).abs().max())


_VLLM_DIST = []


def _init_vllm_distributed():
    if not _VLLM_DIST:
        from vllm.distributed import init_distributed_environment, initialize_model_parallel
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method="tcp://127.0.0.1:29517")
        initialize_model_parallel(1, 1)
        _VLLM_DIST.append(True)


def check_sglang(case_dir, case, sd, config, problems, report):
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.models.dflash import DFlashDraftModel
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.hf_transformers_utils import get_config
    from sglang.test.parallel_groups import publish
    publish(ServerArgs(model_path="dummy", device="cpu"), role="test")
    hf = get_config(str(case_dir / "drafter"), trust_remote_code=False)
    model = DFlashDraftModel(hf).eval()
    fill_nan(model)
    model.load_weights(iter(sd.items()))
    compare_params(model.named_parameters(), sd, "", problems, "sglang")

    def attn(layer):
        a = layer.self_attn
        return a.attn_type == AttentionType.DECODER, (a.sliding_window_size + 1 if a.sliding_window_size >= 0 else None)
    got = [attn(layer) for layer in model.layers]
    want = [expected_attn(config, i) for i in range(len(got))]
    if got != want:
        problems.append(f"sglang: layers resolved (causal, window) {got}, trained {want}")
    report["attention"] = [(a.self_attn.attn_type.value, a.self_attn.sliding_window_size) for a in model.layers]
    report["block_size"] = model.block_size
    report["own_forward"] = _try(lambda: model(case["block_ids"], torch.arange(int(case["anchor"]),
                                                int(case["anchor"]) + len(case["block_ids"])), None,
                                               input_embeds=case["block_embeds"]))
    with torch.no_grad():
        hidden = modules_forward(model, case, attn)
    report["modules_forward_max_diff"] = float((hidden - case["ours"]).abs().max())


def _try(fn) -> str:
    try:
        with torch.no_grad():
            fn()
        return "ran"
    except Exception as e:   # noqa: BLE001 - recorded: why the stack's own forward cannot run here
        frame = traceback.extract_tb(e.__traceback__)[-1]
        return f"not run: {type(e).__name__}: {str(e).splitlines()[0][:200]} ({Path(frame.filename).name}:{frame.lineno})"


def main(case_root: str) -> int:
    from safetensors.torch import load_file
    torch.set_num_threads(1)
    root = Path(case_root)
    problems, report = [], {}
    stacks = {"vllm": lambda *a: check_vllm(a[0], root / "target", *a[1:]), "sglang": check_sglang}
    for case_dir in sorted(p for p in root.iterdir() if (p / "case.safetensors").is_file()):
        case = load_file(str(case_dir / "case.safetensors"))
        sd = load_file(str(case_dir / "drafter" / "model.safetensors"))
        config = json.loads((case_dir / "drafter" / "config.json").read_text())
        for stack, check in stacks.items():
            r = report.setdefault(stack, {}).setdefault(case_dir.name, {})
            before = len(problems)
            try:
                check(case_dir, case, sd, config, problems, r)
            except Exception as e:   # noqa: BLE001 - a stack that cannot build or load our export is a finding
                problems.append(f"{stack}/{case_dir.name}: {type(e).__name__}: {e}")
                r["error"] = traceback.format_exc(limit=-3)
                continue
            if not r["modules_forward_max_diff"] <= TOL:   # NaN too
                problems.append(f"{stack}/{case_dir.name}: hidden states differ from ours by {r['modules_forward_max_diff']:.2e}")
            loaded = "loaded (every parameter ours)" if len(problems) == before else "NOT loaded as exported"
            print(f"{stack:7s} {case_dir.name:11s} {loaded}, attention {r['attention']}, "
                  f"modules forward max |diff| {r['modules_forward_max_diff']:.1e}; own forward {r['own_forward']}")
    report["problems"] = problems
    (root / "serving.json").write_text(json.dumps(report, indent=1) + "\n")
    for p in problems:
        print("FAIL", p)
    print("serving check:", "ok" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "results/serving"))
