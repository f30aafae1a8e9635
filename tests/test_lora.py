"""LoRA: adapters start at the base model, train only themselves (and a classifier head), and merge exactly."""

from __future__ import annotations

import torch

import glassgpt
from glassgpt.training import lora
from glassgpt.training.finetune import to_classifier


def test_lora_wraps_attention_and_feed_forward_and_starts_at_the_base_model(tiny_model):
    ids = torch.randint(0, 97, (2, 9))
    before = tiny_model(ids)
    lora.apply_lora(tiny_model, rank=4, alpha=8)
    wrapped = [name for name, m in tiny_model.named_modules() if isinstance(m, lora.LoRALinear)]
    assert len(wrapped) == 6 * tiny_model.cfg.n_layers
    assert {p.requires_grad for n, p in tiny_model.named_parameters() if "lora_" in n} == {True}
    assert not any(p.requires_grad for n, p in tiny_model.named_parameters() if "lora_" not in n)
    torch.testing.assert_close(tiny_model(ids), before, rtol=0, atol=0)  # B = 0


def test_lora_keeps_a_classifier_head_trainable(tiny_model):
    clf = lora.apply_lora(to_classifier(tiny_model, 2), rank=2, alpha=2)
    trainable = {n for n, p in clf.named_parameters() if p.requires_grad}
    assert {"out_head.weight", "out_head.bias"} <= trainable
    d, L = clf.cfg.emb_dim, clf.cfg.n_layers
    per_block = 4 * (2 * d + d * 2) + (2 * d + 4 * d * 2) + (2 * 4 * d + d * 2)
    assert lora.count_parameters(clf, trainable_only=True) == L * per_block + 2 * d + 2


def _perturb_adapters(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def test_merged_model_gives_the_logits_of_base_plus_adapters(tiny_model):
    lora.apply_lora(tiny_model, rank=4, alpha=16)
    _perturb_adapters(tiny_model)
    ids = torch.randint(0, 97, (3, 12))
    with_adapters = tiny_model(ids)
    copy = lora.merged_model(tiny_model)
    assert not lora.has_lora(copy) and lora.has_lora(tiny_model)
    # Folding B A into W reorders float32 sums: equal up to rounding.
    torch.testing.assert_close(copy(ids), with_adapters, rtol=1e-4, atol=1e-5)
    lora.merge_lora(tiny_model)
    assert not lora.has_lora(tiny_model)
    assert set(tiny_model.state_dict()) == set(copy.state_dict())
    torch.testing.assert_close(tiny_model(ids), with_adapters, rtol=1e-4, atol=1e-5)


def test_merged_checkpoint_loads_as_a_plain_model(tiny_model, tmp_path):
    lora.apply_lora(tiny_model, rank=2, alpha=4)
    _perturb_adapters(tiny_model, seed=1)
    ids = torch.randint(0, 97, (1, 6))
    glassgpt.save_model(lora.merged_model(tiny_model), tmp_path / "m")
    back = glassgpt.load_model(tmp_path / "m", device="cpu")
    torch.testing.assert_close(back(ids), tiny_model(ids), rtol=1e-4, atol=1e-5)


def test_lora_names_stay_importable_from_finetune():
    from glassgpt.training import finetune
    for name in ("LORA_TARGETS", "LoRALinear", "apply_lora", "count_parameters", "has_lora", "lora_state_dict",
                 "merge_lora", "merged_model"):
        assert getattr(finetune, name) is getattr(lora, name)
