"""The lab's tiny transformer (action space = the V symbols, in sampling *and* TRL's scoring), optimizer routing,
KL-drift estimator."""

import copy
import math

import pytest
import torch

from trl_isopo.lab.model import LOGIT_MASK, build_lab_model, symbol_token_ids
from trl_isopo.lab.optim import MuonAdamW, build_optimizer
from trl_isopo.lab.runner import first_below, sequence_kl

V, H = 3, 4


@pytest.fixture(scope="module")
def model_and_tok():
    return build_lab_model(V, H, seed=0)


def test_architecture(model_and_tok):
    model, tok = model_and_tok
    c = model.config
    assert (c.n_embd, c.n_layer, c.n_head, c.n_inner, c.n_positions) == (64, 2, 2, 256, 2 * H)
    assert not c.tie_word_embeddings and c.multi_query is False
    assert symbol_token_ids(tok, V) == [4, 5, 6] and len(tok) == 7
    assert tok("2 0 1 1", add_special_tokens=False)["input_ids"] == [6, 4, 5, 5]
    bias = model.lm_head.bias
    assert not bias.requires_grad and bias.tolist() == [LOGIT_MASK] * 4 + [0.0] * 3


def test_trl_fused_head_scores_sum_to_one_over_symbols(model_and_tok):
    """TRL scores with its fused head (reads lm_head.weight and .bias): probabilities over the V symbols sum to 1."""
    from trl.trainer.utils import add_fused_lm_head

    model = copy.deepcopy(model_and_tok[0])
    add_fused_lm_head(model)
    torch.manual_seed(0)
    ids = torch.randint(4, 4 + V, (5, 2 * H))
    per_label = []
    for token in range(7):  # score every vocabulary id as the label at every position
        labels = torch.full_like(ids, token)
        out = model(input_ids=ids, labels=labels, fused_lm_head=True)
        per_label.append(out.log_probs[:, : 2 * H - 1])
    lp = torch.stack(per_label, -1)  # (5, 2H-1, vocab)
    assert torch.allclose(lp[..., 4:].exp().sum(-1), torch.ones(5, 2 * H - 1), atol=1e-6)
    assert (lp[..., :4] < -1e5).all()
    # ... and they agree with the plain forward that generation uses
    ref = model(input_ids=ids).logits.log_softmax(-1)[:, :-1]
    assert torch.allclose(lp[..., 4:], ref[..., 4:], atol=1e-5)


def test_sampling_emits_exactly_h_symbols(model_and_tok):
    model, tok = model_and_tok
    torch.manual_seed(1)
    prompts = torch.randint(4, 4 + V, (64, H))
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, max_new_tokens=H,
                         top_k=None, top_p=None)
    new = out[:, H:]
    assert new.shape == (64, H)
    assert ((new >= 4) & (new < 4 + V)).all()


def test_saved_copy_keeps_the_mask(model_and_tok, tmp_path):
    """TRL rebuilds the reference model (beta > 0) from a saved directory through the Auto classes."""
    from trl.trainer.utils import create_model_from_path

    model, tok = model_and_tok
    model.save_pretrained(tmp_path)
    ref = create_model_from_path(str(tmp_path))
    assert type(ref) is type(model)
    assert torch.equal(ref.lm_head.bias, model.lm_head.bias)
    ids = torch.tensor([[4, 5, 6, 4, 5]])
    assert torch.allclose(ref(ids).logits, model(ids).logits, atol=1e-5)  # sdpa vs eager rounding


def test_muon_routing_and_step(model_and_tok):
    model = copy.deepcopy(model_and_tok[0])
    opt = build_optimizer(model, "muon", lr=1e-3)
    assert isinstance(opt, MuonAdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)]: g["lr"] for g in opt.muon.param_groups for p in g["params"]}
    adam = {names[id(p)] for g in opt.adamw.param_groups for p in g["params"]}
    assert set(muon) == {"transformer.wte.weight", "transformer.wpe.weight", "lm_head.weight"} | {
        f"transformer.h.{i}.mlp.{m}.weight" for i in range(2) for m in ("c_fc", "c_proj")}
    assert muon["lm_head.weight"] == 1e-3 and muon["transformer.h.1.mlp.c_proj.weight"] == 1e-3
    assert math.isclose(muon["transformer.wte.weight"], 1e-3 * math.sqrt(64 / V))  # Flax (V, 64) table scale
    assert math.isclose(muon["transformer.wpe.weight"], 1e-3 * math.sqrt(64 / (2 * H)))
    assert "transformer.h.0.attn.c_attn.weight" in adam and "transformer.ln_f.bias" in adam
    assert "lm_head.bias" not in adam and len(muon) + len(adam) == sum(p.requires_grad for p in model.parameters())
    assert all(g["weight_decay"] == 0.0 for g in opt.param_groups)

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.tensor([[4, 5, 6, 4, 5, 6, 4, 5]])
    model(ids).logits[..., 4:].log_softmax(-1)[..., 0].sum().backward()
    opt.step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert "lm_head.bias" not in moved
    assert {"transformer.h.0.mlp.c_fc.weight", "transformer.h.0.attn.c_attn.weight", "lm_head.weight"} <= moved

    plain = build_optimizer(model, "adamw")
    assert type(plain) is torch.optim.AdamW and plain.param_groups[0]["weight_decay"] == 0.0
    with pytest.raises(ValueError, match="unknown optimizer"):
        build_optimizer(model, "sgd")


def _exact_sequence_kl(p_model, q_model, prompt, horizon, vocab_ids):
    """Brute force KL(p || q) over all V^H completions of one prompt."""
    import itertools

    seqs = torch.tensor([list(prompt) + list(y) for y in itertools.product(vocab_ids, repeat=horizon)])
    start = len(prompt) - 1
    def seq_logp(m):
        lp = m(seqs).logits[:, start : start + horizon].log_softmax(-1)
        return lp.gather(-1, seqs[:, len(prompt):, None]).squeeze(-1).sum(-1)
    lp, lq = seq_logp(p_model), seq_logp(q_model)
    return float((lp.exp() * (lp - lq)).sum())


@torch.no_grad()
def test_sequence_kl_estimator_matches_brute_force():
    ref, _ = build_lab_model(2, 3, seed=0)
    pol = copy.deepcopy(ref)
    torch.manual_seed(3)
    for p in pol.parameters():
        if p.requires_grad:
            p.add_(0.3 * torch.randn_like(p))
    prompt = [4, 5, 5]
    exact = _exact_sequence_kl(pol, ref, prompt, 3, [4, 5])
    assert exact > 0.05
    assert sequence_kl(ref, ref, torch.tensor([prompt]), 3, 8, torch.Generator().manual_seed(0)) == 0.0
    est = sequence_kl(pol, ref, torch.tensor([prompt]), 3, 4000, torch.Generator().manual_seed(0))
    assert abs(est - exact) < 0.05 * exact + 0.005


def test_first_below():
    assert first_below([0.9, 0.5, 0.009, 0.2], 0.01) == 3
    assert first_below([0.9, 0.5], 0.01) is None
    assert first_below([0.005], 0.01) == 1
