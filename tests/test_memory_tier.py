"""The memory tier's copies: memory reused from commit to commit, never under a reader."""
import gc

import numpy as np
import torch

from ckptd.live.memory_tier import MemoryTier


def _state(k: float):
    model = {"w": torch.full((64, 8), k), "b": torch.arange(8, dtype=torch.float64) + k}
    opt = {"lr": 0.1 * k, "state": {"w": {"step": torch.tensor(k), "exp_avg": torch.full((64, 8), -k)}}}
    return model, opt


def test_commits_copy_into_reserved_memory_and_keep_what_readers_hold():
    tier = MemoryTier()
    tier.reserve(*_state(0.0))
    reserved = list(tier._slots)
    assert len(reserved) == MemoryTier.KEEP + 1
    held = []
    for k in range(1, 4):
        model, opt = _state(float(k))
        held.append(tier.commit(k, model, opt))
        model["w"].fill_(99.0)  # the shadow steps its live tensors on: the copy keeps k
    assert [h.model["w"][0, 0].item() for h in held] == [1.0, 2.0, 3.0]
    assert held[2].optimizer["state"]["w"]["exp_avg"][0, 0].item() == -3.0 and held[2].optimizer["lr"] == 0.1 * 3
    assert tier._slots == reserved  # no fresh memory: three copies, three reserved slots
    # a reader holds only a numpy view of iteration 1's tensor (not the HeldState)
    reader = held[0].model["w"].numpy()[:2]
    del held[0]
    gc.collect()
    for k in range(4, 8):
        tier.commit(k, *_state(float(k)))
    assert np.all(reader == 1.0)  # its memory was not reused while read
    assert tier.iterations() == [6, 7]
    del reader
    before = list(tier._slots)
    held.clear()
    tier.commit(8, *_state(8.0))
    assert tier.latest().model["b"][0].item() == 8.0 and tier.get(7).model["b"][0].item() == 7.0
    assert len(tier._slots) <= MemoryTier.KEEP + 2 and set(map(id, tier._slots)) <= set(map(id, before))


def test_with_a_persistence_writer_one_slot_more_is_reserved():
    tier = MemoryTier()
    tier.reserve(*_state(0.0), writer=True)
    tier.reserve(*_state(0.0), writer=True)  # made once
    assert len(tier._slots) == MemoryTier.KEEP + 2 and all(s.free() for s in tier._slots)


def test_a_state_laid_out_otherwise_gets_its_own_memory():
    tier = MemoryTier()
    tier.reserve(*_state(0.0))
    model, opt = _state(1.0)
    model["extra"] = torch.ones(3)  # a module buffer the plan captures, say
    h = tier.commit(1, model, opt)
    assert h.model["extra"].tolist() == [1.0, 1.0, 1.0] and len(tier._slots) == 1  # the old layout let go
