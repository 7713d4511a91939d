"""Quantized checkpoints as the target: an FP8 (block-wise float8_e4m3fn, Qwen3-*-FP8's format) copy of a tiny Llama
and an MXFP4 (GPT-OSS's experts) copy of a tiny GPT-OSS, loaded by the pipeline's own `load_target`. On a CPU
transformers dequantizes both (FP8 needs a GPU of compute capability >= 8.9, MXFP4 a GPU or the `kernels` package):
these tests prove the format is read exactly (each weight equals its blocks times their scales) and that capture,
training and lossless decoding run on it; the served precision is the `gpu` test's (FP8 layers on an H100)."""
import pytest
import torch

from dflash.config_model import TargetSection
from dflash.evaluate import specdec as S
from dflash.families import check_model
from dflash.target import load_target
from support import families as F


@pytest.fixture(scope="module")
def built(family_targets, one_thread):
    return {f: family_targets(f) for f in ("llama", "gpt_oss")}


def _load(path, device="cpu", **kw):
    attn = "eager" if path.name.startswith("gpt_oss") else "sdpa"
    return load_target(TargetSection.model_validate({"path": str(path), "build": "none", "attn_implementation": attn,
                                                     **kw}), device)


@pytest.mark.parametrize("family,method", [("llama", "fp8"), ("gpt_oss", "mxfp4")])
def test_a_quantized_checkpoint_loads_exactly_as_its_format_says(built, tmp_path, family, method):
    want = F.quantized_copy(built[family], tmp_path / f"{family}-{method}", method)
    target = _load(tmp_path / f"{family}-{method}")
    got = dict(target.named_parameters())
    assert want and all(torch.equal(got[k].float(), v) for k, v in want.items())    # dequantized on the CPU, exactly
    assert check_model(target) is None
    ids = torch.randint(0, 320, (1, 16), generator=torch.Generator().manual_seed(0))
    assert F.capture_problem(target, ids, [1, 2]) is None
    prompt = ids[0].tolist()
    assert S.speculative_generate(target, S.RandomDraft(320, 4), prompt, 12).tokens == \
        S.target_generate(target, prompt, 12).tokens


@pytest.mark.gpu
def test_fp8_checkpoint_runs_in_fp8_on_a_gpu(built, tmp_path):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability >= 8.9")
    F.quantized_copy(built["llama"], tmp_path / "fp8", "fp8")
    target = _load(tmp_path / "fp8", "cuda", dtype="bfloat16")
    q = target.model.layers[0].self_attn.q_proj
    assert q.weight.dtype == torch.float8_e4m3fn and check_model(target) is None      # served precision, not bf16
    ids = torch.randint(0, 320, (1, 16), generator=torch.Generator().manual_seed(0)).cuda()
    cap = F.capture_problem(target, ids, [1, 2])
    assert cap is None, cap
