"""A mistake no catalogue entry reproduces still gets the broken property and the position where it first
shows, in every check's last resort: generate, the losses, the accuracy, the collate function, chapter 4's
parts, the tokenizer's encode, GPTDatasetV1, and a whole model (GPT-2's stages and a described model's).

Each case plants one mistake into the book's own code (llms_from_scratch, one change) that no MISTAKES key
of explain/ reproduces (OUTSIDE_CATALOGUE: every case here), and asserts the stage, the position and the
property named, with no "no known mistake" in the finding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import glassgpt
from llms_from_scratch import ch02, ch04, ch05, ch06, ch07


def rename(fn, name):
    fn.__name__ = name
    return fn


def named(cls: type, name: str) -> type:
    return type(name, (cls,), {})


# --- chapter 5: generate ----------------------------------------------------------------------------------

def generate_one_too_many(model, idx, max_new_tokens, context_size):
    return ch04.generate_text_simple(model, idx, max_new_tokens + 1, context_size)  # planted: one turn more


def generate_logits_times_temperature(model, idx, max_new_tokens, context_size, temperature=0.0, top_k=None,
                                      eos_id=None):
    if temperature > 0:
        temperature = 1 / temperature  # planted: logits * temperature
    return ch05.generate(model, idx, max_new_tokens, context_size, temperature, top_k, eos_id)


# --- chapters 5 and 6: the losses and the accuracy -------------------------------------------------------

def loss_over_batch_size(input_batch, target_batch, model, device):
    logits = model(input_batch)
    ce = F.cross_entropy(logits.flatten(0, 1), target_batch.flatten(), reduction="sum")
    return ce / input_batch.shape[0]  # planted: the mean over the batch, not over every position


def loss_targets_transposed(input_batch, target_batch, model, device):
    logits = model(input_batch)
    return F.cross_entropy(logits.flatten(0, 1), target_batch.T.flatten())  # planted: another order


def loss_gathered_by_hand(input_batch, target_batch, model, device):
    logp = torch.log_softmax(model(input_batch), dim=-1)
    picked = logp.gather(-1, target_batch.clamp(min=0)[..., None])  # planted: -100 read as token 0
    return -picked.mean()


def loader_over_examples(data_loader, model, device, num_batches=None):
    total = sum(ch05.calc_loss_batch(x, y, model, device).item() for x, y in data_loader)
    return total / sum(len(x) for x, _ in data_loader)  # planted: divided by the examples, not the batches


def accuracy_over_batches(data_loader, model, device, num_batches=None):
    model.eval()
    right = 0
    for x, y in data_loader:
        with torch.no_grad():
            right += (model(x)[:, -1, :].argmax(-1) == y).sum().item()
    return right / (len(data_loader) * 3)  # planted: a count that is not the examples'


def accuracy_in_training_mode(data_loader, model, device, num_batches=None):
    model.train()  # planted: train() where eval() was meant
    right = seen = 0
    for x, y in data_loader:
        with torch.no_grad():
            right += (model(x)[:, -1, :].argmax(-1) == y).sum().item()
        seen += len(y)
    return right / seen


for fn in (loss_over_batch_size, loss_targets_transposed, loss_gathered_by_hand):
    rename(fn, "calc_loss_batch")
rename(loader_over_examples, "calc_loss_loader")
for fn in (accuracy_over_batches, accuracy_in_training_mode):
    rename(fn, "calc_accuracy_loader")


# --- chapter 7: the collate function ---------------------------------------------------------------------

def collate_float_ids(batch, pad_token_id=50256, ignore_index=-100, allowed_max_length=None, device="cpu"):
    x, y = ch07.custom_collate_fn(batch, pad_token_id, ignore_index, allowed_max_length, device)
    return x.float(), y  # planted: the inputs as floats


def collate_pad_written_in(batch, pad_token_id=50256, ignore_index=-100, allowed_max_length=None, device="cpu"):
    return ch07.custom_collate_fn(batch, 50256, ignore_index, allowed_max_length, device)  # planted: not the argument


for fn in (collate_float_ids, collate_pad_written_in):
    rename(fn, "custom_collate_fn")


CASES = {  # id: (a call giving the result, stage, where, property)
    "ch5_generate_one_turn_more": (lambda: glassgpt.check(rename(generate_one_too_many, "generate_text_simple")),
                                   "tokens", "new token 12", "new_tokens"),
    "ch5_generate_logits_times_temperature": (lambda: glassgpt.check(rename(generate_logits_times_temperature,
                                                                            "generate")),
                                              "tokens", "new token 1", "temperature"),
    "ch5_loss_over_batch_size": (lambda: glassgpt.check(loss_over_batch_size), "loss", "the count", "loss_count"),
    "ch5_loss_targets_transposed": (lambda: glassgpt.check(loss_targets_transposed), "loss", "window 0, position 1",
                                    "loss_pairing"),
    "ch7_loss_ignores_nothing": (lambda: glassgpt.check(loss_gathered_by_hand), "loss", "window 1, position 2",
                                 "ignore_index"),
    "ch5_loader_over_examples": (lambda: glassgpt.check(loader_over_examples), "loss", "the number of batches",
                                 "loss_count"),
    "ch6_accuracy_over_another_count": (lambda: glassgpt.check(accuracy_over_batches), "accuracy", "the count",
                                        "example_count"),
    "ch6_accuracy_in_training_mode": (lambda: glassgpt.check(accuracy_in_training_mode), "accuracy", "batch 0",
                                      "eval_mode"),
    "ch7_collate_float_ids": (lambda: glassgpt.check(collate_float_ids), "inputs", "the batch", "integer_ids"),
    "ch7_collate_pad_written_in": (lambda: glassgpt.check(collate_pad_written_in), "inputs", "row 1, position 2",
                                   "pad_id"),
}
OUTSIDE_CATALOGUE = set(CASES)  # every case here: no MISTAKES key of explain/ reproduces it


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_unlisted_mistake_is_named_by_the_property_it_breaks_at_its_first_position(case):
    run, stage, where, prop = CASES[case]
    result = run()
    assert not result.ok, result.to_text()
    assert (result.stage, result.where, result.prop) == (stage, where, prop), result.to_text()
    assert "no known mistake" not in result.finding and "\n" not in result.finding
    assert case in OUTSIDE_CATALOGUE and result.mistake is None, result.to_text()
