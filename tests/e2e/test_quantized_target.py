"""Quantized checkpoints as the target: an FP8 (block-wise float8_e4m3fn, Qwen3-*-FP8's format) copy of a tiny Llama
and an MXFP4 (GPT-OSS's experts) copy of a tiny GPT-OSS, loaded by the pipeline's own `load_target`. On a CPU
transformers dequantizes both (FP8 needs a GPU of compute capability >= 8.9, MXFP4 a GPU or the `kernels` package):
these tests prove the format is read exactly (each weight equals its blocks times their scales) and that capture,
training and lossless decoding run on it; the `gpu` test loads the FP8 copy on a GPU (in FP8 only where transformers'
`kernels` package is installed: dflash.target.fp8_loading)."""
import pytest
import torch

from dflash.config_model import TargetSection
from dflash.evaluate import specdec as S
from dflash.families import check_model
from dflash.target import fp8_loading, load_target, target_config
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


def test_an_fp8_checkpoint_is_dequantized_where_its_kernel_would_download(built, tmp_path, monkeypatch):
    """transformers' FP8 layers fetch their kernel from the Hub (`kernels`): without a usable `kernels` the checkpoint
    loads dequantized (a GPU forward would fail otherwise), keeping the checkpoint's own quantization keys."""
    import transformers.utils
    want = F.quantized_copy(built["llama"], tmp_path / "fp8", "fp8")
    cfg = tmp_path / "fp8" / "config.json"
    cfg.write_text(cfg.read_text().replace('"weight_block_size"', '"modules_to_not_convert": ["lm_head"], '
                                                                   '"weight_block_size"'))
    monkeypatch.setattr(transformers.utils, "is_kernels_available", lambda *a, **k: False)
    def loading(path):
        return fp8_loading(target_config(TargetSection.model_validate({"path": str(path), "build": "none"})), path)
    qc = loading(tmp_path / "fp8")["quantization_config"]
    assert qc.dequantize and qc.weight_block_size == [16, 16] and qc.modules_to_not_convert == ["lm_head"]
    got = dict(_load(tmp_path / "fp8").named_parameters())
    assert all(torch.equal(got[k].float(), v) for k, v in want.items())
    assert loading(built["llama"]) == {}                          # not quantized
    monkeypatch.setattr(transformers.utils, "is_kernels_available", lambda *a, **k: True)
    assert loading(tmp_path / "fp8") == {}                        # transformers' own FP8 layers where they can run


@pytest.mark.gpu
def test_fp8_checkpoint_runs_on_a_gpu(built, tmp_path):
    """In FP8 where transformers' kernel is installed; else dequantized (fp8_loading), as loaded on the device."""
    from transformers.utils import is_kernels_available
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability >= 8.9")
    F.quantized_copy(built["llama"], tmp_path / "fp8", "fp8")
    target = _load(tmp_path / "fp8", "cuda", dtype="bfloat16")
    q = target.model.layers[0].self_attn.q_proj
    want = torch.float8_e4m3fn if is_kernels_available() else torch.bfloat16
    assert q.weight.dtype == want and check_model(target) is None
    ids = torch.randint(0, 320, (1, 16), generator=torch.Generator().manual_seed(0)).cuda()
    cap = F.capture_problem(target, ids, [1, 2])
    assert cap is None, cap
