import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sbp_torch._layout._philox import counters_used, philox4x32, random_values, region_flat_indices

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _s64(x: int) -> int:
    """Unsigned 64-bit value -> the int64 with the same bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


# Random123 known-answer vectors for philox4x32-10: counter words, key words, output words.
KAT = [
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    (
        [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344],
        [0xA4093822, 0x299F31D0],
        [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1],
    ),
]


@pytest.mark.parametrize("ctr,key,expected", KAT)
def test_known_answer_vectors(ctr, key, expected):
    lo = torch.tensor([_s64(ctr[0] | ctr[1] << 32)])
    hi = torch.tensor([_s64(ctr[2] | ctr[3] << 32)])
    out = philox4x32(lo, hi, key[0] | key[1] << 32)
    assert out.dtype == torch.int64 and out.shape == (1, 4)
    assert out[0].tolist() == expected
    # a negative seed is read as its 64-bit two's complement
    if key == [0xFFFFFFFF] * 2:
        assert philox4x32(lo, hi, -1)[0].tolist() == expected


def test_philox_shape_and_range():
    lo = torch.arange(24, dtype=torch.int64).view(2, 3, 4) - 12
    out = philox4x32(lo, torch.zeros_like(lo), 1234)
    assert out.shape == (2, 3, 4, 4)
    assert out.min() >= 0 and out.max() < 2**32
    # each counter is independent of its neighbours in the batch
    assert torch.equal(out[1, 2, 3], philox4x32(lo[1, 2, 3], lo.new_tensor(0), 1234))


def test_counters_used():
    assert [counters_used(n) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]


def test_region_flat_indices_basic():
    assert region_flat_indices((), (), ()).shape == ()
    assert region_flat_indices((), (), ()).item() == 0
    assert region_flat_indices((3, 0, 2), (1, 0, 0), (2, 0, 2)).shape == (2, 0, 2)
    assert region_flat_indices((5,), (2,), (0,)).shape == (0,)
    full = torch.arange(60).view(3, 4, 5)
    idx = region_flat_indices((3, 4, 5), (1, 1, 2), (2, 3, 3))
    assert idx.dtype == torch.int64
    assert torch.equal(idx, full[1:3, 1:4, 2:5])
    with pytest.raises(ValueError):
        region_flat_indices((3,), (2,), (2,))


@st.composite
def shape_and_region(draw):
    ndim = draw(st.integers(0, 4))
    shape = draw(st.lists(st.sampled_from([0, 1, 2, 3, 5, 7, 9, 13]), min_size=ndim, max_size=ndim))
    starts, lengths = [], []
    for size in shape:
        start = draw(st.integers(0, size))
        starts.append(start)
        lengths.append(draw(st.integers(0, size - start)))
    return shape, starts, lengths


@settings(max_examples=150, deadline=None)
@given(
    sr=shape_and_region(),
    kind=st.sampled_from(["uniform", "normal"]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(-(2**63), 2**64 - 1),
    offset=st.integers(0, 2**40),
)
def test_region_matches_slice_of_whole(sr, kind, dtype, seed, offset):
    shape, starts, lengths = sr
    whole_idx = region_flat_indices(shape, [0] * len(shape), shape)
    whole = random_values(kind, whole_idx, seed, offset, dtype)
    assert whole.shape == tuple(shape) and whole.dtype == dtype
    part = random_values(kind, region_flat_indices(shape, starts, lengths), seed, offset, dtype)
    expected = whole[tuple(slice(s, s + n) for s, n in zip(starts, lengths))]
    assert part.shape == tuple(lengths) and part.dtype == dtype
    assert torch.equal(part, expected)


@pytest.mark.parametrize("kind", ["uniform", "normal"])
def test_arbitrary_index_order_and_single_elements(kind):
    n = 1003
    whole = random_values(kind, torch.arange(n), 7, 3, torch.float32)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    assert torch.equal(random_values(kind, perm, 7, 3, torch.float32), whole[perm])
    singles = torch.cat([random_values(kind, torch.tensor([i]), 7, 3, torch.float32) for i in range(0, n, 37)])
    assert torch.equal(singles, whole[::37])


def test_offset_shifts_counters():
    # element i at offset k+1 equals element i+4 at offset k: offsets count counters.
    a = random_values("uniform", torch.arange(4, 40), 11, 5, torch.float64)
    b = random_values("uniform", torch.arange(0, 36), 11, 6, torch.float64)
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_normal_statistics(dtype):
    z = random_values("normal", torch.arange(200_000), 2024, 0, dtype).double()
    assert torch.isfinite(z).all()
    assert abs(z.mean().item()) < 0.02
    assert abs(z.std().item() - 1.0) < 0.02
    # each Box-Muller lane on its own is standard normal too
    for lane in range(4):
        zl = z[lane::4]
        assert abs(zl.mean().item()) < 0.03 and abs(zl.std().item() - 1.0) < 0.03


@pytest.mark.parametrize("dtype", DTYPES)
def test_uniform_statistics(dtype):
    u = random_values("uniform", torch.arange(200_000), 99, 0, dtype)
    assert u.dtype == dtype and torch.isfinite(u).all()
    assert u.min() >= 0 and u.max() < 1
    ud = u.double()
    assert abs(ud.mean().item() - 0.5) < 0.01
    assert abs(ud.var().item() - 1.0 / 12) < 0.01
    hist = torch.histc(ud, bins=10, min=0, max=1) / ud.numel()
    assert (hist - 0.1).abs().max() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_words_stay_in_range(dtype, monkeypatch):
    # Force the extreme 32-bit words 0 and 2**32-1 through the float conversions.
    import sbp_torch._layout._philox as ph

    def fake(lo, hi, seed):
        w = torch.tensor([0, 2**32 - 1, 2**32 - 1, 0], dtype=torch.int64)
        return w.expand(*lo.shape, 4)

    monkeypatch.setattr(ph, "philox4x32", fake)
    u = ph.random_values("uniform", torch.arange(8), 0, 0, dtype)
    assert u.min() == 0 and u.max() < 1
    z = ph.random_values("normal", torch.arange(8), 0, 0, dtype)
    assert torch.isfinite(z).all()
    assert z.abs().max().item() <= math.sqrt(2 * 32 * math.log(2)) + 0.05


def test_streams_differ():
    idx = torch.arange(1000)
    base = random_values("uniform", idx, 1, 0, torch.float64)
    for other in (
        random_values("uniform", idx, 2, 0, torch.float64),
        random_values("uniform", idx, 1, counters_used(1000), torch.float64),
        random_values("uniform", idx, 1 + 2**32, 0, torch.float64),  # high key word matters
    ):
        assert (other != base).float().mean() > 0.99
    n1 = random_values("normal", idx, 1, 0, torch.float32)
    n2 = random_values("normal", idx, 1, 1, torch.float32)
    assert (n1 != n2).float().mean() > 0.99
    # deterministic
    assert torch.equal(base, random_values("uniform", idx, 1, 0, torch.float64))


def test_errors_and_device():
    idx = torch.arange(4)
    with pytest.raises(ValueError):
        random_values("poisson", idx, 0, 0, torch.float32)
    with pytest.raises(TypeError):
        random_values("uniform", idx, 0, 0, torch.int32)
    assert random_values("normal", idx, 0, 0, torch.float32).device == idx.device
    assert random_values("uniform", torch.tensor(5), 0, 0, torch.float32).shape == ()
