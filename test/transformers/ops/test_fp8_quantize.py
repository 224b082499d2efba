"""The FP8 quantisers (rows, transposed columns, transposed group columns) against an independent float64 rounding.

The reference here does not use torch's float8 cast: it computes the scale amax / 448 and its inverse 448 / amax in
float64 (rounded to fp32 they are the correctly rounded fp32 quotients, as float64 has more than 2 * 24 + 2 bits),
multiplies by the inverse in float64 (exact, then rounded to fp32), clamps, and picks the nearest of e4m3's 127
finite non-negative values, decoded from their bit fields, ties to the even code. Scales and fp8 bit patterns must be
equal, not close.
"""

import pytest
import torch

from liger_dspine.ops.fp8_quantize import FP8_DTYPE
from liger_dspine.ops.fp8_quantize import padded_group_offsets
from liger_dspine.ops.fp8_quantize import quantize_columns
from liger_dspine.ops.fp8_quantize import quantize_columns_reference
from liger_dspine.ops.fp8_quantize import quantize_group_columns
from liger_dspine.ops.fp8_quantize import quantize_group_columns_reference
from liger_dspine.ops.fp8_quantize import quantize_rowwise
from liger_dspine.ops.fp8_quantize import quantize_rowwise_reference

EPS = 1e-12


def e4m3_values() -> torch.Tensor:
    """The values of codes 0..126 (127 is NaN), ascending: exponent e = code >> 3, mantissa m = code & 7."""
    codes = torch.arange(127, dtype=torch.float64)
    e, m = torch.div(codes, 8, rounding_mode="floor"), codes % 8
    return torch.where(e == 0, m * 2.0**-9, (1 + m / 8) * 2.0 ** (e - 7))


def e4m3_codes(y: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3 codes of float64 y (|y| <= 448), rounded to nearest, ties to the even code; -0 keeps its sign."""
    values = e4m3_values()
    a = y.abs().contiguous()
    upper = torch.searchsorted(values, a).clamp(max=126)
    lower = (upper - 1).clamp(min=0)
    d_lower, d_upper = a - values[lower], values[upper] - a
    pick_upper = (d_upper < d_lower) | ((d_upper == d_lower) & (upper % 2 == 0))
    code = torch.where(pick_upper, upper, lower)
    return (code + 128 * torch.signbit(y).long()).to(torch.uint8)


def expected_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [M, C] uint8, scale [M] fp32) of a rowwise quantisation, in float64."""
    x64 = x.double()
    amax = x64.abs().amax(dim=-1) if x.shape[-1] else x64.new_zeros(x.shape[:-1])
    amax = amax.clamp(min=torch.tensor(EPS, dtype=torch.float32).item())
    scale, inverse = (amax / 448).float(), (448 / amax).float()  # correctly rounded fp32 quotients
    # the fp64 product of two fp32 values is exact: rounded once to fp32, it is the fp32 product
    y = (x64 * inverse.double()[..., None]).float().double().clamp(-448, 448)
    return e4m3_codes(y), scale


def codes(q: torch.Tensor) -> torch.Tensor:
    assert q.dtype == FP8_DTYPE
    return q.view(torch.uint8)


def assert_same_quantisation(q, scale, ref_q, ref_scale) -> None:
    """Equal scales and equal e4m3 codes; the message names the first codes that differ."""
    assert torch.equal(scale, ref_scale), f"{(scale != ref_scale).sum().item()} scales differ"
    differ = (codes(q) != codes(ref_q)).nonzero()
    shown = [(tuple(i), q[tuple(i)].item(), ref_q[tuple(i)].item()) for i in differ[:5].tolist()]
    assert len(differ) == 0, f"{len(differ)} codes differ (index, kernel, reference): {shown}"


def spread(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values over nine decades per row (so subnormal e4m3 codes occur), a zero row, a -0 and exact ties."""
    generator = torch.Generator().manual_seed(seed)
    decades = torch.logspace(-7, 2, cols)[torch.randperm(cols, generator=generator)]
    x = torch.randn(rows, cols, generator=generator) * decades
    if rows > 2 and cols > 4:
        x[1] = 0.0
        x[2, 0] = -0.0
        # with amax 448 the scale is 1: ties between two normal and two subnormal e4m3 values
        x[2, 1:5] = torch.tensor([448.0, 336.0, -13.5, 3 * 2.0**-10])
        x[2, 5:] = x[2, 5:].clamp(-448, 448)
    return x.to(dtype)


DTYPES = [torch.float32, torch.float16, torch.bfloat16]  # bf16 runs the torch reference on a CPU


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, cols", [(5, 37), (3, 1), (4, 300)])
def test_rows_match_float64_rounding(dtype, rows, cols):
    x = spread(rows, cols, dtype, seed=rows * cols)
    q, scale = quantize_rowwise(x)
    want_codes, want_scale = expected_rows(x)
    assert q.shape == x.shape and scale.shape == (rows,) and scale.dtype == torch.float32
    assert torch.equal(scale, want_scale)
    assert torch.equal(codes(q), want_codes)
    ref_q, ref_scale = quantize_rowwise_reference(x)
    assert torch.equal(codes(ref_q), want_codes) and torch.equal(ref_scale, want_scale)


def test_rows_wider_than_one_block():
    x = spread(2, 8200, torch.float32, seed=3)  # two passes over the row
    q, scale = quantize_rowwise(x)
    want_codes, want_scale = expected_rows(x)
    assert torch.equal(scale, want_scale) and torch.equal(codes(q), want_codes)


def test_rows_round_trip_error_is_within_e4m3():
    x = spread(4, 64, torch.float32, seed=7)
    q, scale = quantize_rowwise(x)
    back = q.double() * scale.double()[:, None]
    # 3 mantissa bits: 2^-4 relative (normal range), 2^-10 * scale absolute (subnormal range), plus three fp32
    # roundings (the scale, its inverse and the product), each 2^-24 relative
    bound = (2.0**-4 + 2.0**-21) * x.double().abs() + 2.0**-10 * scale.double()[:, None]
    assert ((back - x.double()).abs() <= bound).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 20), (16, 3), (3, 40, 24), (0, 8), (300, 70)])  # 300: two row blocks
def test_columns_are_transposed_rows_with_zero_padding(dtype, shape):
    x = spread(shape[-2] * (shape[0] if len(shape) == 3 else 1), shape[-1], dtype, seed=sum(shape)).view(shape)
    q, scale = quantize_columns(x)
    rows, cols = shape[-2:]
    padded = -(-rows // 16) * 16
    assert q.shape == (*shape[:-2], cols, padded) and scale.shape == (*shape[:-2], cols)
    want_codes, want_scale = expected_rows(x.transpose(-2, -1))
    assert torch.equal(scale, want_scale)
    assert torch.equal(codes(q)[..., :rows], want_codes)
    assert (codes(q)[..., rows:] == 0).all()
    ref_q, ref_scale = quantize_columns_reference(x)
    assert torch.equal(codes(ref_q), codes(q)) and torch.equal(ref_scale, scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("counts", [[3, 0, 17, 17, 3], [0, 0, 16], [40], [0, 5, 0]])
def test_group_columns(dtype, counts):
    rows, cols = sum(counts), 24
    x = spread(rows, cols, dtype, seed=rows + len(counts)) if rows else torch.zeros(0, cols, dtype=dtype)
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    q, scale, padded_ends = quantize_group_columns(x, offs)

    padded = [max(-(-c // 16), 1) * 16 for c in counts]
    total = -(-rows // 16) * 16 + 16 * len(counts)
    assert padded_ends.dtype == torch.int32 and padded_ends.tolist() == torch.tensor(padded).cumsum(0).tolist()
    assert q.shape == (cols, total) and scale.shape == (len(counts), cols)
    assert sum(padded) <= total and total % 16 == 0
    start = padded_start = 0
    for group, count in enumerate(counts):
        want_codes, want_scale = expected_rows(x[start : start + count].t())
        assert torch.equal(scale[group], want_scale)
        assert torch.equal(codes(q)[:, padded_start : padded_start + count], want_codes)
        assert (codes(q)[:, padded_start + count : padded_start + padded[group]] == 0).all()
        start, padded_start = start + count, padded_start + padded[group]
    assert (codes(q)[:, padded_start:] == 0).all()
    ref = quantize_group_columns_reference(x, offs)
    assert torch.equal(codes(ref[0]), codes(q)) and torch.equal(ref[1], scale) and torch.equal(ref[2], padded_ends)


def test_padded_offsets_bound():
    offs = torch.tensor([1, 1, 33, 34], dtype=torch.int32)
    ends, total = padded_group_offsets(offs, 34)
    assert ends.tolist() == [16, 32, 64, 80] and total == 48 + 64


def test_bad_inputs():
    with pytest.raises(ValueError, match="liger-dspine: FP8 rowwise"):
        quantize_rowwise(torch.zeros(2, 3, 4, 5))
    with pytest.raises(ValueError, match="liger-dspine: FP8 column"):
        quantize_columns(torch.zeros(4, dtype=torch.float32))
    with pytest.raises(ValueError, match="fp16/bf16/fp32"):
        quantize_rowwise(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="int32"):
        quantize_group_columns(torch.zeros(4, 3), torch.tensor([4]))


@pytest.mark.cuda
def test_kernels_match_reference_on_cuda_bf16():
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 7168, device="cuda", generator=generator).mul_(3).bfloat16()
    assert_same_quantisation(*quantize_rowwise(x), *quantize_rowwise_reference(x))
    assert_same_quantisation(*quantize_columns(x), *quantize_columns_reference(x))
    q, scale, column_amax = quantize_rowwise(x, with_column_amax=True)  # several row blocks a program, atomics
    assert_same_quantisation(q, scale, *quantize_rowwise_reference(x))
    assert torch.equal(column_amax.view(torch.float32), x.float().abs().amax(dim=0))
    assert_same_quantisation(*quantize_columns(x, column_amax), *quantize_columns_reference(x))
    w = torch.randn(8, 2048, 7168, device="cuda", generator=generator).bfloat16()
    assert_same_quantisation(*quantize_columns(w), *quantize_columns_reference(w))
    q, scale, column_amax = quantize_rowwise(w, with_column_amax=True)  # per expert
    assert_same_quantisation(q, scale, *quantize_rowwise_reference(w))
    assert torch.equal(column_amax.view(torch.float32), w.float().abs().amax(dim=1))
    assert_same_quantisation(*quantize_columns(w, column_amax), *quantize_columns_reference(w))
    counts = torch.tensor([700, 0, 1, 1500, 16, 900, 0, 979])
    offs = counts.cumsum(0).to(device="cuda", dtype=torch.int32)
    q, scale, ends = quantize_group_columns(x, offs)
    ref_q, ref_scale, ref_ends = quantize_group_columns_reference(x, offs)
    assert torch.equal(ends, ref_ends) and torch.equal(scale, ref_scale) and torch.equal(codes(q), codes(ref_q))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows, cols, programs", [(37, 20, 512), (300, 70, 1), (700, 24, 1), (3, 8200, 512)])
def test_rows_pass_finds_the_column_amax_the_column_quantiser_needs(dtype, rows, cols, programs, monkeypatch):
    """The rows op's column amax (one row block a program, several blocks a program merged atomically, or the
    separate amax pass for rows wider than one block) is each column's largest |x|, and given to the column
    quantiser it gives what that quantiser finds by itself."""
    from liger_dspine.ops import fp8_quantize

    monkeypatch.setattr(fp8_quantize, "_FUSED_AMAX_PROGRAMS", programs)  # 1: every row block in one program
    x = spread(rows, cols, dtype, seed=rows + cols)
    q, scale, column_amax = quantize_rowwise(x, with_column_amax=True)
    assert_same_quantisation(q, scale, *quantize_rowwise(x))
    assert column_amax.dtype == torch.int32 and column_amax.shape == (cols,)
    assert torch.equal(column_amax.view(torch.float32), x.float().abs().amax(dim=0))
    assert_same_quantisation(*quantize_columns(x, column_amax), *quantize_columns(x))


def test_batched_columns_take_a_column_amax_per_batch():
    x = spread(2 * 40, 24, torch.float32, seed=11).view(2, 40, 24)
    amax = torch.stack([quantize_rowwise(x[b], with_column_amax=True)[2] for b in range(2)])
    assert_same_quantisation(*quantize_columns(x, amax), *quantize_columns(x))
    assert_same_quantisation(*quantize_columns(x, amax), *quantize_columns_reference(x))


@pytest.mark.parametrize("batches, rows, cols, programs", [(3, 37, 20, 512), (4, 300, 70, 1), (2, 5, 8200, 512)])
def test_batched_rows_find_each_batchs_column_amax(batches, rows, cols, programs, monkeypatch):
    """x [B, M, C] (a stack of expert weights): rows quantised as those of x.view(B * M, C), and the column amax
    per batch over its own M rows (one row block a program, several merged atomically, or the amax pass for rows
    wider than one block), which the batched column quantiser takes in place of its own pass."""
    from liger_dspine.ops import fp8_quantize

    monkeypatch.setattr(fp8_quantize, "_FUSED_AMAX_PROGRAMS", programs)
    x = spread(batches * rows, cols, torch.float32, seed=batches + rows).view(batches, rows, cols)
    x[1] *= 1000  # batches of very different ranges: an amax merged across batches would show
    q, scale, column_amax = quantize_rowwise(x, with_column_amax=True)
    assert q.shape == x.shape and scale.shape == (batches, rows) and column_amax.shape == (batches, cols)
    flat_q, flat_scale = quantize_rowwise(x.view(batches * rows, cols))
    assert_same_quantisation(q.view(-1, cols), scale.view(-1), flat_q, flat_scale)
    assert_same_quantisation(*quantize_rowwise(x), *quantize_rowwise_reference(x))
    assert torch.equal(column_amax.view(torch.float32), x.abs().amax(dim=1))
    assert_same_quantisation(*quantize_columns(x, column_amax), *quantize_columns_reference(x))


def test_rows_of_a_strided_view_are_read_in_place():
    """Rows with a stride larger than their width (a slice of columns) quantise as their contiguous copy."""
    x = spread(30, 48, torch.float32, seed=5)[:, 8:40]
    assert x.stride(0) == 48
    q, scale, amax = quantize_rowwise(x, with_column_amax=True)
    assert_same_quantisation(q, scale, *quantize_rowwise(x.contiguous()))
    assert torch.equal(amax, quantize_rowwise(x.contiguous(), with_column_amax=True)[2])


def test_a_column_amax_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match="one value per column"):
        quantize_columns(torch.zeros(4, 8), torch.zeros(7, dtype=torch.int32))
