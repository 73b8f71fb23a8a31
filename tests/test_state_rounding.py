"""kernels/state_rounding.py: the PyTorch rounding against plain-Python and table oracles (the hash as published,
the two 16-bit neighbours of every value, torch's own cast), stochastic rounding's mean, its seeding, and the
Triton device functions against the PyTorch references bit for bit (on a CPU through the interpreter, in a
child process)."""
import pytest
import torch
import triton
import triton.language as tl

from kernels._common import INTERPRET
from kernels.state_rounding import (StochasticRounding, check_rounding, hash32_ref, round_ref, row_seed,
                                    row_seed_ref, stochastic_bits_ref, store_state, to_fp32)

RUNS_TRITON = INTERPRET or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
HALF_DTYPES = [torch.float16, torch.bfloat16]
MASK32 = 0xFFFFFFFF


def lowbias32(x: int) -> int:
    """The hash as published (C. Wellons, hash-prospector), on Python ints."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def special_values():
    big, tiny = 3.4e38, 1e-40  # near fp32's largest; an fp32 subnormal
    values = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"), 1.0, -1.5 + 2**-12, 1 + 2**-11,
              1 + 3 * 2**-12, 1 + 2**-8, 1 + 2**-9, 65504.0, 65519.0, 65520.0, 65535.0, 65536.0, -70000.0, 1e30, big,
              -big, 2**-14, 2**-15, 3 * 2**-16, 2**-24, 2**-25, 3 * 2**-26, 2**-26, 2**-126, 2**-127, 1.2e-38, tiny,
              -tiny, 2**-149]
    return torch.tensor(values, dtype=torch.float32)


def sample_values(n=3000, seed=0):
    """Special values, then signed values log-uniform over the whole fp32 range (subnormals included)."""
    g = torch.Generator().manual_seed(seed)
    exponent = torch.rand(n, generator=g) * 280 - 150
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    values = (sign * torch.rand(n, generator=g).add(1) * torch.pow(2.0, exponent.double())).float()
    return torch.cat([special_values(), values])


def bits16(t):
    return t.view(torch.int16).to(torch.int64) & 0xFFFF


def grid(dtype):
    """Every non-negative value of dtype in order, inf last: the stochastic neighbours' table."""
    values = torch.arange(0x8000, dtype=torch.int64)
    values = torch.where(values >= 0x8000, values - 0x10000, values).to(torch.int16).view(dtype).float()
    finite = values[torch.isfinite(values)]
    return torch.cat([finite.sort().values, torch.tensor([float("inf")])])


def test_hash_matches_the_published_lowbias32():
    xs = [0, 1, 2, 0x7FFFFFFF, 0x80000000, MASK32] + torch.randint(0, 2**32, (200,)).tolist()
    got = hash32_ref(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [lowbias32(x) for x in xs]


def test_seeds_follow_the_documented_formula():
    counter = torch.tensor([0, 5, -1, 2**31 - 1], dtype=torch.int32)
    expected = [lowbias32((c & MASK32) ^ lowbias32(77)) for c in counter.tolist()]
    assert row_seed_ref(counter, 77).tolist() == expected
    rounding = StochasticRounding(counter, 77)
    bits = stochastic_bits_ref(rounding, torch.tensor([2, 0], dtype=torch.int32), (2, 3))
    assert bits.shape == (2, 2, 3)
    assert bits[0, 1, 2].item() == lowbias32(5 ^ expected[2])  # element (1, 2) is index 5 of a [2, 3] slot tensor
    assert bits[1, 0, 0].item() == lowbias32(expected[0])


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=["fp16", "bf16"])
def test_nearest_is_the_plain_cast(dtype):
    x = sample_values()
    assert torch.equal(bits16(round_ref(x, dtype)), bits16(x.to(dtype)))


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=["fp16", "bf16"])
def test_stochastic_lands_on_a_neighbour(dtype):
    """Every value rounds to one of its two neighbours in the 16-bit grid (beyond the largest finite value,
    inf), sign kept; exact values, zeros, inf and NaN stay."""
    rows = 8
    x = sample_values().expand(rows, -1)
    rounding = StochasticRounding(torch.arange(rows, dtype=torch.int32), 3)
    bits = stochastic_bits_ref(rounding, torch.arange(rows, dtype=torch.int32), x.shape[1:])
    got = round_ref(x, dtype, bits).float()
    table = grid(dtype)
    ax = x.abs()
    finite = torch.isfinite(x)
    hi = torch.searchsorted(table, ax[finite])
    lo = torch.where(table[hi] == ax[finite], hi, hi - 1)
    mag = got.abs()[finite]
    assert ((mag == table[lo]) | (mag == table[hi])).all()
    assert torch.equal(torch.signbit(got[finite]), torch.signbit(x[finite]))
    assert torch.equal(got[torch.isinf(x)], x[torch.isinf(x)])
    assert torch.isnan(got[torch.isnan(x)]).all()
    exact = finite & (x.to(dtype).float() == x)
    assert torch.equal(got[exact], x[exact])
    # both neighbours are taken somewhere: the rounding is not a disguised truncation
    between = table[lo] != table[hi]
    assert (mag[between] == table[hi][between]).any() and (mag[between] == table[lo][between]).any()


@pytest.mark.parametrize("dtype,x,gap", [
    (torch.float16, 1 + 0.3 * 2**-10, 2**-10),
    (torch.float16, -(1 + 0.7 * 2**-10), 2**-10),
    (torch.float16, 2.3 * 2**-24, 2**-24),  # subnormal
    (torch.float16, 0.3 * 2**-24, 2**-24),  # below the smallest subnormal: 0 or 2^-24
    (torch.float16, 1000.6, 0.5),
    (torch.bfloat16, 1 + 0.3 * 2**-7, 2**-7),
    (torch.bfloat16, -(3 + 0.9 * 2**-6), 2**-6),
    (torch.bfloat16, 1.3 * 2**-133, 2**-133),  # subnormal
], ids=["fp16", "fp16-neg", "fp16-subnormal", "fp16-below-subnormal", "fp16-large", "bf16", "bf16-neg",
        "bf16-subnormal"])
def test_stochastic_is_unbiased(dtype, x, gap):
    """The mean over many counters (and elements) is x within 4 standard errors; nearest is off by its
    fixed rounding error, many standard errors."""
    x = torch.tensor(x, dtype=torch.float32).item()  # the fp32 value actually rounded
    counters, per = 256, 256
    rounding = StochasticRounding(torch.arange(counters, dtype=torch.int32), 11)
    bits = stochastic_bits_ref(rounding, torch.arange(counters, dtype=torch.int32), (per,))
    values = torch.full((counters, per), x)
    mean = round_ref(values, dtype, bits).double().mean().item()
    up = (abs(x) / gap) % 1  # the probability of rounding away from zero
    se = gap * (up * (1 - up) / values.numel()) ** 0.5
    assert abs(mean - x) < 4 * se
    assert abs(round_ref(values, dtype).double().mean().item() - x) > 20 * se


def test_stochastic_is_deterministic_and_seeded_by_counter_and_salt():
    x = torch.randn(3, 500) * 10
    slots = torch.tensor([0, 1, 2], dtype=torch.int32)

    def rounded(counter, salt):
        rounding = StochasticRounding(torch.tensor(counter, dtype=torch.int32), salt)
        return bits16(round_ref(x, torch.bfloat16, stochastic_bits_ref(rounding, slots, (500,))))

    base = rounded([4, 4, 9], 1)
    assert torch.equal(base, rounded([4, 4, 9], 1))
    assert torch.equal(base[0], bits16(round_ref(x[:1], torch.bfloat16, stochastic_bits_ref(
        StochasticRounding(torch.tensor([4], dtype=torch.int32), 1), torch.tensor([0], dtype=torch.int32),
        (500,))))[0])
    for other in (rounded([4, 4, 9], 2), rounded([5, 5, 10], 1)):
        assert (other != base).any(dim=1).all()
    # the slot is not hashed: two rows with one counter draw the same bits for the same element
    same = stochastic_bits_ref(StochasticRounding(torch.tensor([4, 4], dtype=torch.int32), 1),
                               torch.tensor([0, 1], dtype=torch.int32), (500,))
    assert torch.equal(same[0], same[1])


def test_fp32_is_stored_as_is():
    x = sample_values()
    assert round_ref(x, torch.float32) is x


@pytest.mark.parametrize("rounding,slots,match", [
    ("stochastic", 3, "rounding must be None, 'nearest' or StochasticRounding"),
    ((torch.zeros(3, dtype=torch.int64), 1), 3, r"counter must be an int32 \[3\] tensor .* got torch.int64"),
    ((torch.zeros(2, dtype=torch.int32), 1), 3, r"counter must be an int32 \[3\] tensor .* got torch.int32 \[2\]"),
    (([0, 0, 0], 1), 3, "counter must be an int32 .* got list"),
    ((torch.zeros(3, dtype=torch.int32), -1), 3, r"salt must be an int in \[0, 2\*\*31\)"),
    ((torch.zeros(3, dtype=torch.int32), 2**31), 3, r"salt must be an int in \[0, 2\*\*31\)"),
    ((torch.zeros(3, dtype=torch.int32), 1.0), 3, "salt must be an int"),
    ((torch.zeros(3, dtype=torch.int32).to("meta"), 1), 3, "counter is on meta"),
], ids=["string", "counter-dtype", "counter-shape", "counter-list", "salt-negative", "salt-large", "salt-float",
        "counter-device"])
def test_bad_rounding_is_rejected(rounding, slots, match):
    with pytest.raises(ValueError, match=match):
        check_rounding(rounding, slots, torch.device("cpu"))


def test_good_rounding_is_accepted():
    counter = torch.zeros(3, dtype=torch.int32)
    assert check_rounding(None, 3, torch.device("cpu")) is None
    assert check_rounding("nearest", 3, torch.device("cpu")) is None
    assert check_rounding((counter, 5), 3, torch.device("cpu")) == StochasticRounding(counter, 5)


# ---------------------------------------------------------------------------------------------------------
# Triton device functions against the references, bit for bit

@triton.jit(do_not_specialize=["salt"])
def _round_kernel(x_ptr, out_ptr, counter_ptr, slot_ptr, salt, n, STOCHASTIC: tl.constexpr, BLOCK: tl.constexpr):
    """Row r of x [R, n] stored into out (its dtype) as the row of slot slot_ids[r]."""
    row = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    mask = i < n
    slot = tl.load(slot_ptr + row)
    x = tl.load(x_ptr + row * n + i, mask=mask)
    seed = row_seed(tl.load(counter_ptr + slot), salt)
    store_state(out_ptr + row * n + i, x, mask, STOCHASTIC, seed, i)


@triton.jit
def _widen_kernel(src_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, to_fp32(tl.load(src_ptr + i, mask=i < n)), mask=i < n)


INTERPRETER_CASES = "triton_matches"  # run on a CPU through the interpreter (tests/triton_interpreter.py)


@pytest.mark.skipif(RUNS_TRITON, reason="this process runs the Triton functions directly")
def test_triton_under_interpreter(interpreter_cases):
    interpreter_cases.check(__file__)


@pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
@pytest.mark.parametrize("dtype", [torch.float32] + HALF_DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_triton_matches_reference(dtype, stochastic):
    x = sample_values().view(1, -1).repeat(3, 1)
    x[1:] *= torch.rand(2, 1) * 3  # other values in the other rows
    rows, n = x.shape
    counter = torch.tensor([7, -3, 2**30, 12], dtype=torch.int32)
    slot_ids = torch.tensor([3, 0, 1], dtype=torch.int32)
    out = torch.empty(rows, n, dtype=dtype)
    args = [t.to(DEVICE) for t in (x, out, counter, slot_ids)]
    _round_kernel[(rows,)](*args, 12345, n, STOCHASTIC=stochastic, BLOCK=triton.next_power_of_2(n))
    bits = stochastic_bits_ref(StochasticRounding(counter, 12345), slot_ids, (n,)) if stochastic else None
    expected = round_ref(x, dtype, bits)
    got = args[1].cpu()
    nan = torch.isnan(x)
    assert torch.isnan(got[nan]).all()
    if dtype == torch.float32:
        assert torch.equal(got[~nan].view(torch.int32), expected[~nan].view(torch.int32))
    else:
        assert torch.equal(bits16(got[~nan]), bits16(expected[~nan]))


@pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=["fp16", "bf16"])
def test_triton_matches_torch_widening(dtype):
    """Every 16-bit pattern widens to torch's fp32 value (subnormals included; NaN stays NaN)."""
    src = torch.arange(-0x8000, 0x8000, dtype=torch.int32).to(torch.int16).view(dtype)
    out = torch.empty(src.shape, dtype=torch.float32, device=DEVICE)
    _widen_kernel[(triton.cdiv(src.numel(), 4096),)](src.to(DEVICE), out, src.numel(), BLOCK=4096)
    want = src.float()
    nan = torch.isnan(want)
    assert torch.equal(out.cpu()[~nan].view(torch.int32), want[~nan].view(torch.int32))
    assert torch.isnan(out.cpu()[nan]).all()
