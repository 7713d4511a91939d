"""The drafter learns: a tiny random Qwen3 target, a synthetic corpus where each sequence follows one of two
fixed token permutations (so the next token depends on the anchor token AND on the context), a few hundred
AdamW steps on CPU."""
import time

import torch

from dflash.model import DFlashDrafter, DrafterConfig, block_labels, dflash_loss, sample_anchors

V, MASK, S = 64, 63, 40


def _corpus(n, perms, g):
    seq = torch.empty(n, S, dtype=torch.long)
    which = torch.randint(0, len(perms), (n,), generator=g)
    seq[:, 0] = torch.randint(0, MASK, (n,), generator=g)
    for t in range(1, S):
        seq[:, t] = perms[which, seq[:, t - 1]]
    return seq


def test_drafter_learns_a_context_dependent_pattern():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # tiny shapes: one thread is several times faster on a shared machine
    try:
        _learn()
    finally:
        torch.set_num_threads(threads)


def _learn():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    t0 = time.time()
    torch.manual_seed(0)
    tcfg = Qwen3Config(vocab_size=V, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=128)
    target = Qwen3ForCausalLM(tcfg).eval()
    g = torch.Generator().manual_seed(0)
    perms = torch.stack([torch.randperm(MASK, generator=g) for _ in range(2)])
    train, held = _corpus(256, perms, g), _corpus(64, perms, g)
    cfg = DrafterConfig.from_target(tcfg, dict(num_layers=2, num_target_layers=3, block_size=4), mask_token_id=MASK)
    assert cfg.target_layer_ids == [1, 2, 3]

    with torch.no_grad():
        def features(ids):
            hs = target(ids, output_hidden_states=True).hidden_states
            return torch.cat([hs[i + 1] for i in cfg.target_layer_ids], -1)
        f_train, f_held = features(train), features(held)
    embed, head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    torch.manual_seed(1)
    drafter = DFlashDrafter(cfg, embed, head)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3, betas=(0.9, 0.95))
    lm = torch.ones(1, S, dtype=torch.bool)
    lm[:, :4] = False                                      # an unsupervised "prompt"

    def evaluate():
        an = sample_anchors(lm.expand(len(held), S), 8, cfg.block_size, generator=torch.Generator().manual_seed(9))
        labels, w = block_labels(held, lm.expand(len(held), S), an)
        with torch.no_grad():
            out = dflash_loss(drafter(f_held, held, an), head, labels, w, cfg.block_size, chunk=256)
        return float(out.loss), out.accuracy.tolist(), float(out.acceptance_estimate)

    loss0, acc0, _ = evaluate()
    for step in range(300):
        idx = torch.randint(0, len(train), (16,), generator=g)
        ids = train[idx]
        an = sample_anchors(lm.expand(16, S), 8, cfg.block_size, generator=g)
        labels, w = block_labels(ids, lm.expand(16, S), an)
        out = dflash_loss(drafter(f_train[idx], ids, an), head, labels, w, cfg.block_size, chunk=128)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
    loss1, acc1, tau1 = evaluate()
    print(f"loss {loss0:.3f} -> {loss1:.3f}; acc {acc0} -> {acc1}; accepted prefix {tau1:.2f}; "
          f"{time.time() - t0:.1f}s")
    assert loss1 < 0.6 * loss0
    assert acc0[0] < 0.1
    # chance is 1/63; ignoring the context caps position 1 at about 0.5 (two permutations)
    assert acc1[0] > 0.75
    assert tau1 > 1.0
