"""The static-shape decode step (`LeanDecoder.static_step`, what torch.compile and CUDA graphs take)
against the growing-slice step it replaces.

Both compute the same attention: the static step reads the whole [P+S] cache with the columns not
yet written masked out, and a masked column adds exactly 0 to the softmax; only the summation's
blocking can differ. The comparison runs in float64, where that reordering moves a result by a few
units of 2**-53 relative, so 1e-12 absolute on the logits (|logits| < 10 here) is far above the
rounding on any CPU and far below any real difference (a wrong column or position moves the
logits by ~1e-2 and more, as the last test shows).
"""

import torch

from rlgraph.backends.local.lean_decode import LeanDecoder
from rlgraph.backends.local.models import build_causal_lm


def decode(model, kind: str, *, rows=5, width=6, steps=7, seed=0, shift=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 20, (rows, width), generator=gen)  # [N, P]
    mask = torch.ones(rows, width, dtype=torch.bool)  # [N, P]
    mask[1, :2] = False  # a left-padded prompt
    mask[3, :4] = False
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # [N, P]
    decoder = LeanDecoder(model)
    with torch.no_grad():
        logits = [decoder.start(ids, mask, positions, steps)]  # [N, V]
        for _ in range(steps - 1):
            token = logits[-1].argmax(-1)  # [N]
            if kind == "static":
                logits.append(decoder.static_step(token))
                if shift and len(logits) == 2:  # once: a skipped cache column, to show the comparison can fail
                    decoder.position.add_(shift)
            else:
                logits.append(decoder.step(token))
    return torch.stack(logits, 1)  # [N, S, V]


def model64():
    return build_causal_lm(None, dtype=torch.float64).eval()


def test_the_static_step_computes_the_growing_steps_logits():
    model = model64()
    want, got = decode(model, "growing"), decode(model, "static")
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert (got - want).abs().max() <= 1e-12


def test_the_static_step_advances_its_position_on_the_device():
    model = model64()
    decoder = LeanDecoder(model)
    ids, mask = torch.randint(3, 20, (2, 4)), torch.ones(2, 4, dtype=torch.bool)
    with torch.no_grad():
        logits = decoder.start(ids, mask, torch.arange(4).expand(2, 4), 3)
        decoder.static_step(logits.argmax(-1))
        decoder.static_step(logits.argmax(-1))
    assert decoder.position.tolist() == [6] and decoder.position.device == ids.device


def test_a_wrong_cache_column_is_caught():
    model = model64()
    assert (decode(model, "static", shift=1) - decode(model, "growing")).abs().max() > 1e-3


def test_the_columns_not_yet_written_are_zeros():
    """The static step reads every column of the cache with a mask; a masked column still multiplies
    its value by 0, so garbage there (NaN bit patterns of uninitialised memory) would poison the
    output. Found as NaN log-probs in a compiled run whose allocator handed back dirty memory."""
    model = model64()
    decoder = LeanDecoder(model)
    ids, mask = torch.randint(3, 20, (2, 4)), torch.ones(2, 4, dtype=torch.bool)
    with torch.no_grad():
        decoder.start(ids, mask, torch.arange(4).expand(2, 4), 5)
    for keys, values in decoder.cache:  # [N, Hkv, P+S, D]
        assert keys[:, :, 4:].count_nonzero() == 0 and values[:, :, 4:].count_nonzero() == 0
        assert keys[:, :, :4].count_nonzero() > 0
