"""16-bit state storage with fp32 math: loads widen exactly to fp32, stores round back to the table's dtype
(fp16 or bf16), to nearest or stochastically. Triton device functions, and their PyTorch references beside
them, which agree bit for bit (NaN payloads aside).

Stochastic rounding stores x's neighbour above or below with probability given by the distance: unbiased
(E[stored] = x), so rounding errors do not accumulate a drift over long streams as round-to-nearest's can.
Its random bits are a hash, reproducible and computed on the device without host work per step (the step
runs inside CUDA graphs):

    seed  = hash32(counter[slot] ^ hash32(salt))     per store of a slot's state (once per sequence of
                                                     rows, kernels/_common.py): counter is the runner's
                                                     int32 [S] step counter, salt an int telling layers
                                                     and tensors apart
    bits  = hash32(index ^ seed)                     per element: index is its flat index in the slot's tensor

hash32 is lowbias32 (C. Wellons): two multiplies and three xor-shifts on uint32. The slot is not hashed, so a
symbol's state rounds the same whichever slot holds it.

    nearest: the plain cast (round half to even);
    bf16: add the top 16 bits of `bits` to x's fp32 bit pattern and drop its low 16 bits;
    fp16: lo = x rounded toward zero, g = the fp16 gap above |lo| (a power of two); store lo one step away
          from zero when u * g < |x - lo|, u = the low 23 bits of `bits` as a fraction in [0, 1). Every term
          is exact in fp32.
          Beyond 65504 the next value is taken as 65536: inf with probability (|x| - 65504) / 32.

Zeros keep their sign, subnormals round on their own grid, inf stays inf and NaN stays NaN (its payload may
change). Cost per stored element over the plain cast, counted in the sm_90 SASS of mlstm_step: 14 instructions
for bf16 and 22 for fp16, 9 of them the hash (the plain cast itself: about 1 over an fp32 store).

The Triton interpreter (the CPU tests) truncates fp32 to bf16 where a GPU rounds to nearest, and rounds
subnormals wrongly toward zero: there the two casts are written out in bits and steps, giving what the GPU's
own casts give.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels._common import INTERPRET

# Triton reads this global as a compile-time constant
INTERPRETED = tl.constexpr(INTERPRET)
STATE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MASK32 = 0xFFFFFFFF


class StochasticRounding(NamedTuple):
    """`rounding=` of the state ops: round 16-bit state stores stochastically, seeded by counter (int32 [S], the
    per-slot step counter, read at each sequence's slot before the step advances it) and salt (an int in
    [0, 2**31), distinct per layer and tensor). A plain (counter, salt) tuple works too."""
    counter: torch.Tensor
    salt: int


def check_rounding(rounding, slots: int, device: torch.device):
    """None or "nearest" -> None; StochasticRounding / (counter, salt) -> a checked StochasticRounding."""
    if rounding is None or (isinstance(rounding, str) and rounding == "nearest"):
        return None
    if not isinstance(rounding, tuple) or len(rounding) != 2:
        raise ValueError(f"rounding must be None, 'nearest' or StochasticRounding(counter, salt), got {rounding!r}")
    counter, salt = rounding
    if not isinstance(counter, torch.Tensor) or counter.dtype != torch.int32 or counter.shape != (slots,):
        got = f"{counter.dtype} {list(counter.shape)}" if isinstance(counter, torch.Tensor) else type(counter).__name__
        raise ValueError(f"the rounding counter must be an int32 [{slots}] tensor (one per slot), got {got}")
    if counter.device != device:
        raise ValueError(f"the rounding counter is on {counter.device}, expected {device} like the state")
    if isinstance(salt, bool) or not isinstance(salt, int) or not 0 <= salt < 2**31:
        raise ValueError(f"the rounding salt must be an int in [0, 2**31), got {salt!r}")
    return StochasticRounding(counter, salt)


def kernel_args(state: torch.Tensor, rounding, slot_ids: torch.Tensor):
    """(counter, counter slot stride, salt, STOCHASTIC) for a kernel storing `state` with a checked `rounding`;
    without stochastic rounding slot_ids stands in for the counter, which is then never read."""
    if rounding is None or state.dtype == torch.float32:
        return slot_ids, 0, 0, False
    return rounding.counter, rounding.counter.stride(0), rounding.salt, True


# ---------------------------------------------------------------------------------------------------------
# Triton

@triton.jit
def hash32(x):
    """lowbias32 of a uint32 tensor."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def row_seed(counter, salt):
    """The row's seed from its slot's counter (int32, loaded) and the call's salt (int32)."""
    return hash32(counter.to(tl.uint32, bitcast=True) ^ hash32(salt.to(tl.uint32, bitcast=True)))


@triton.jit
def to_fp32(v):
    """Loaded state values (fp32, fp16 or bf16) as fp32, exactly."""
    if v.dtype == tl.bfloat16:
        v = (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        v = v.to(tl.float32)
    return v


@triton.jit
def _bf16_nearest(x):
    if INTERPRETED:  # PyTorch's round half to even, in bits (a NaN keeps its sign and top payload, quieted)
        b = x.to(tl.uint32, bitcast=True)
        hi = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        hi = tl.where(x != x, (b >> 16) | 0x40, hi)
        return hi.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _fp16_toward_zero(x):
    if INTERPRETED:  # to nearest, then one step back toward zero where that went past x
        near = x.to(tl.float16)
        back = (tl.abs(near.to(tl.float32)) > tl.abs(x)).to(tl.int16)
        return (near.to(tl.int16, bitcast=True) - back).to(tl.float16, bitcast=True)
    else:
        return x.to(tl.float16, fp_downcast_rounding="rtz")


@triton.jit
def _bf16_stochastic(x, bits):
    b = x.to(tl.uint32, bitcast=True)
    hi = (b + (bits >> 16)) >> 16
    hi = tl.where(x != x, (b >> 16) | 0x40, hi)  # a NaN's payload could carry into the sign
    return hi.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _fp16_stochastic(x, bits):
    lo = _fp16_toward_zero(x)
    lo_f = lo.to(tl.float32)
    # the gap above |lo|: 2^-10 of its binade, 2^-24 among the subnormals
    gap = tl.maximum((lo_f.to(tl.int32, bitcast=True) & 0x7F800000) - (10 << 23), 0x33800000)
    u = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True) - 1.0
    up = u * gap.to(tl.float32, bitcast=True) < tl.abs(x - lo_f)
    return (lo.to(tl.int16, bitcast=True) + up.to(tl.int16)).to(tl.float16, bitcast=True)


@triton.jit
def store_state(ptrs, x, mask, STOCHASTIC: tl.constexpr, seed, index):
    """Store fp32 x at ptrs in their dtype: fp32 as is; fp16/bf16 to nearest, or stochastically (STOCHASTIC)
    with the row's seed (row_seed) and each element's flat index within the slot's tensor (int32)."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        if STOCHASTIC:
            x = _bf16_stochastic(x, hash32(index.to(tl.uint32, bitcast=True) ^ seed))
        else:
            x = _bf16_nearest(x)
    elif ptrs.dtype.element_ty == tl.float16:
        if STOCHASTIC:
            x = _fp16_stochastic(x, hash32(index.to(tl.uint32, bitcast=True) ^ seed))
        else:
            x = x.to(tl.float16)
    tl.store(ptrs, x, mask=mask)


# ---------------------------------------------------------------------------------------------------------
# PyTorch references: the same integer steps in int64 tensors holding uint32 values

def _mul32(x, c: int):
    """x * c mod 2^32 for x in [0, 2^32), as two products that stay far below int64 overflow."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def hash32_ref(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_seed_ref(counter: torch.Tensor, salt: int) -> torch.Tensor:
    """row_seed for int32 counters (any shape) -> int64 seeds."""
    salt_hash = hash32_ref(torch.tensor(salt, dtype=torch.int64, device=counter.device))
    return hash32_ref((counter.to(torch.int64) & MASK32) ^ salt_hash)


def stochastic_bits_ref(rounding: StochasticRounding, slot_ids: torch.Tensor, shape) -> torch.Tensor:
    """hash32(index ^ seed) of every element of each row's slot tensor: int64 [B, *shape]."""
    seed = row_seed_ref(rounding.counter[slot_ids.long()], rounding.salt)
    index = torch.arange(int(torch.Size(shape).numel()), device=seed.device).view(shape)
    return hash32_ref(index ^ seed.view(-1, *[1] * len(shape)))


def _as16(bits: torch.Tensor, dtype) -> torch.Tensor:
    bits = bits & 0xFFFF
    return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(dtype)


def round_ref(x: torch.Tensor, dtype, bits=None) -> torch.Tensor:
    """fp32 x in `dtype`: fp32 as is; fp16/bf16 to nearest, or stochastically with `bits` (int64 holding
    uint32, x's shape: stochastic_bits_ref), as store_state does."""
    if dtype == torch.float32:
        return x
    if dtype not in STATE_DTYPES:
        raise ValueError(f"state dtype must be one of {STATE_DTYPES}, got {dtype}")
    x = x.float()
    if bits is None:
        return x.to(dtype)
    if dtype == torch.bfloat16:
        b = x.contiguous().view(torch.int32).to(torch.int64) & MASK32
        hi = ((b + (bits >> 16)) & MASK32) >> 16
        return _as16(torch.where(torch.isnan(x), (b >> 16) | 0x40, hi), dtype)
    near = x.half()
    lo = near.view(torch.int16).to(torch.int64) - (near.float().abs() > x.abs()).long()  # toward zero
    lo_f = _as16(lo, dtype).float()
    gap = ((lo_f.view(torch.int32).to(torch.int64) & 0x7F800000) - (10 << 23)).clamp(min=0x33800000)
    u = ((bits & 0x7FFFFF) | 0x3F800000).to(torch.int32).view(torch.float32) - 1.0
    up = u * gap.to(torch.int32).view(torch.float32) < (x - lo_f).abs()
    return _as16(lo + up.long(), dtype)


def store_ref(table: torch.Tensor, slot_ids: torch.Tensor, x: torch.Tensor, rounding) -> None:
    """table[slot_ids] = x (fp32 [B, *slot shape]), rounded as store_state rounds it; `rounding` a checked
    StochasticRounding or None (nearest)."""
    bits = None
    if table.dtype != torch.float32 and rounding is not None:
        bits = stochastic_bits_ref(rounding, slot_ids, table.shape[1:])
    table[slot_ids.long()] = round_ref(x, table.dtype, bits)
