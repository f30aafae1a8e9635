"""engine/pages.py: a long generation moves the weights onto 2 MB pages, and nothing else changes.

What is checked: the tensors keep their objects and values and get new addresses in a mapping the
kernel was asked to back with 2 MB pages (the `hg` flag of /proc/self/smaps); a native step planned
before the move keeps reading the old copies (equal logits), is stale, and the engine plans again,
after which the old memory is held by nothing; `generate` moves only from `PAYS_AT` new tokens, and
never where transparent huge pages are off or the copy would not fit in free memory. The speed is a
benchmark's (benchmarks/RESULTS.md, "2 MB pages"), not a test's.
"""

from __future__ import annotations

import sys

import pytest
import torch

import glassgpt
from glassgpt.engine import Engine, KVCache, advice, pages
from glassgpt.generate import generate

from conftest import needs_kernels
from helpers import decode_with

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")

# vocab 2048 x 128 float32: a 1 MB embedding (MIN_BYTES), the rest smaller
CFG = glassgpt.GPTConfig(vocab_size=2048, context_length=64, emb_dim=128, n_heads=4, n_layers=2, qkv_bias=True)


def small_model() -> glassgpt.GPTModel:
    return glassgpt.load_model("gpt2", device="cpu", dtype="float32", seed=0, config=CFG).eval()


def vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping of this process that holds `address`."""
    lines = open("/proc/self/smaps").read().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.fixture
def thp_on(monkeypatch, tmp_path):
    """This kernel's THP switch read as `madvise` (a kernel built without THP skips: madvise would fail)."""
    if not pages.THP.exists():
        pytest.skip("this kernel has no transparent huge pages")
    fake = tmp_path / "enabled"
    fake.write_text("always [madvise] never\n")
    monkeypatch.setattr(pages, "THP", fake)


def test_the_weights_move_onto_a_mapping_advised_for_2mb_pages_with_their_objects_and_values(thp_on):
    model = small_model()
    before = {name: (t, t.detach().clone(), t.data_ptr()) for name, t in model.state_dict(keep_vars=True).items()}
    moved = pages.move_to_large_pages(model)
    big = [name for name, (t, _, _) in before.items() if t.nbytes >= pages.MIN_BYTES]
    assert "tok_emb.weight" in big and all(before[name][0].nbytes < pages.MIN_BYTES for name in before if name not in big)
    assert moved >= before["tok_emb.weight"][0].nbytes
    for name, (t, values, ptr) in before.items():
        now = model.state_dict(keep_vars=True)[name]
        assert now is t and torch.equal(now, values)  # the same object, the same values
        assert (now.data_ptr() != ptr) == (name in big)  # only the large ones moved
    assert "hg" in vm_flags(model.tok_emb.weight.data_ptr())  # MADV_HUGEPAGE
    assert pages.move_to_large_pages(model) == 0  # once


def test_a_step_planned_before_the_move_reads_the_old_copy_then_the_engine_plans_again(thp_on):
    needs_kernels()
    model = small_model()
    engine = Engine(model)
    decode_with(engine, "native")
    ids = torch.randint(0, CFG.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    cache = KVCache(model.cfg, 1, 12)
    with torch.inference_mode():
        engine.prefill(ids[:, :4], cache)
        want = engine.decode_one(ids[:, 4], cache).clone()
        old_step, old_ptr = engine.step, model.tok_emb.weight.data_ptr()
        assert pages.move_to_large_pages(model) > 0
        assert old_step.stale()
        cache.pos = 4
        got = old_step(ids[:, 4]).clone()  # the plan's addresses still hold the weights' old copies
        assert torch.equal(got, want)
        cache.pos = 4
        again = engine.decode_one(ids[:, 4], cache)
    assert engine.step is not old_step and not engine.step.stale()
    assert torch.equal(again, want)
    assert all(t.data_ptr() != old_ptr for t in engine.step.keep)  # nothing of the new plan holds the old copy


def test_generate_moves_from_pays_at_new_tokens_only(thp_on, monkeypatch):
    calls = []
    monkeypatch.setattr(pages, "move_to_large_pages", lambda model: calls.append(model) or 0)
    monkeypatch.setattr(pages, "PAYS_AT", 16)
    model = small_model()
    generate(model, [1, 2, 3], 15)
    assert calls == []  # 15 new tokens: not worth a copy
    generate(model, [[1, 2, 3], [4, 5, 6]], 8)
    assert calls == [model]  # 2 rows x 8 = 16
    generate(model, [1, 2, 3], 16, use_cache=False)
    assert calls == [model]  # the book's loop (no engine) never moves


def test_generate_gives_the_same_tokens_with_the_move(thp_on, monkeypatch):
    monkeypatch.setattr(pages, "PAYS_AT", 16)
    model = small_model()
    want = generate(small_model(), [1, 2, 3], 15)
    got = generate(model, [1, 2, 3], 16)
    assert getattr(model.tok_emb.weight, "_glassgpt_large_pages", False)
    assert torch.equal(got[:, :want.shape[1]], want)


@pytest.mark.parametrize("switch", ["always madvise [never]", None])
def test_nothing_moves_where_transparent_huge_pages_are_off(monkeypatch, tmp_path, switch):
    fake = tmp_path / "enabled"
    if switch is not None:
        fake.write_text(switch + "\n")
    monkeypatch.setattr(pages, "THP", fake)  # None: the file is missing (no THP in this kernel)
    model = small_model()
    ptr = model.tok_emb.weight.data_ptr()
    assert pages.move_to_large_pages(model) == 0 and model.tok_emb.weight.data_ptr() == ptr
    line = advice.pages_line(pages.mode())
    assert line.startswith("pages: 4 KB pages only") and ("never" in line) == (switch is not None)


def test_nothing_moves_where_the_copy_would_not_fit_in_free_memory(thp_on, monkeypatch):
    model = small_model()
    monkeypatch.setattr(pages, "free_bytes", lambda: model.tok_emb.weight.nbytes)  # under 1.25x the copy
    ptr = model.tok_emb.weight.data_ptr()
    assert pages.move_to_large_pages(model) == 0 and model.tok_emb.weight.data_ptr() == ptr


def test_info_says_a_long_generation_moves_onto_2mb_pages(thp_on):
    line = advice.pages_line(pages.mode())
    assert line.startswith(f"pages: a generation of {pages.PAYS_AT:,}+ new tokens moves the weights onto 2 MB pages")
    assert "madvise" in line


def test_a_moved_model_saves_and_loads_as_before(thp_on, tmp_path):
    """Each moved tensor has a storage of its own (torch.save writes a view's whole storage), and a checkpoint
    of the moved model loads with the same values."""
    from glassgpt.formats.glassgpt import save_model
    model = small_model()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    assert pages.move_to_large_pages(model) > 0
    weight = model.tok_emb.weight
    assert weight.untyped_storage().nbytes() == weight.nbytes
    torch.save(weight.detach(), tmp_path / "one.pt")
    assert (tmp_path / "one.pt").stat().st_size < weight.nbytes + 4096
    save_model(model, tmp_path / "moved")
    back = glassgpt.load_model(tmp_path / "moved").state_dict()
    assert sorted(back) == sorted(want) and all(torch.equal(back[k], want[k]) for k in want)
