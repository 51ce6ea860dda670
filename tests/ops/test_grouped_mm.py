"""moe_plugin::grouped_mm (torch's F.grouped_mm behind our custom op) against the per-expert loop."""
import pytest
import torch

from moe_plugin import ops
from moe_plugin.ops.grouped import grouped_mm_loop

CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])


def _counts(E, R, empty_first=True):
    """Random rows per group with some empty groups; they sum to at most R (the rest are past the end)."""
    counts = torch.randint(0, max(1, R // E + 3), (E,))
    if empty_first:
        counts[0] = 0
    while counts.sum() > R:
        counts[int(counts.argmax())] -= 1
    return counts


def _loop_3d(a, b, counts, bias):
    """Plain per-group loop in fp64: rows past the groups give 0."""
    out, start = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64), 0
    for e, n in enumerate(counts.tolist()):
        out[start:start + n] = a[start:start + n].double() @ b[e].double()
        if bias is not None:
            out[start:start + n] += bias[e].double()
        start += n
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float64, 1e-12)])
@pytest.mark.parametrize("I, O", [(16, 24), (7, 5), (9, 32), (16, 5)])     # odd widths: the padded path
@pytest.mark.parametrize("with_bias", [False, True])
def test_rows_times_group_weights(device, dtype, tolerance, I, O, with_bias):
    E, R = 5, 43
    counts = _counts(E, R - 4)          # at least 4 rows past the last group
    a = torch.randn(R, I, dtype=dtype, device=device)
    a[int(counts.sum()):] = float("nan")    # rows past the last offset must not leak
    b = torch.randn(E, I, O, dtype=dtype, device=device)
    bias = torch.randn(E, O, dtype=dtype, device=device) if with_bias else None
    out = ops.grouped_mm(a, b, ops.offsets(counts, device), bias)
    expected = _loop_3d(a.cpu(), b.cpu(), counts, None if bias is None else bias.cpu())
    assert out.dtype == dtype and out.shape == (R, O)
    assert torch.equal(out[int(counts.sum()):].cpu(), torch.zeros(R - int(counts.sum()), O, dtype=dtype))
    kept = int(counts.sum())
    scale = expected[:kept].abs().max().clamp(min=1)
    assert float((out[:kept].cpu().double() - expected[:kept]).abs().max() / scale) <= tolerance


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float64, 1e-12)])
@pytest.mark.parametrize("I, O", [(16, 24), (7, 5)])
def test_weight_gradient_form(device, dtype, tolerance, I, O):
    E, R = 4, 37
    counts = _counts(E, R - 3)
    x = torch.randn(R, I, dtype=dtype, device=device)
    g = torch.randn(R, O, dtype=dtype, device=device)
    g[int(counts.sum()):] = float("nan")
    out = ops.grouped_mm(x.t(), g, ops.offsets(counts, device))
    assert out.shape == (E, I, O) and out.dtype == dtype
    start = 0
    for e, n in enumerate(counts.tolist()):
        expected = x[start:start + n].double().t() @ g[start:start + n].double()
        scale = expected.abs().max().clamp(min=1)
        assert float((out[e].double() - expected).abs().max() / scale) <= tolerance
        start += n


def test_fp32_grouped_mm_equals_the_loop_bit_for_bit():
    E, R, I, O = 6, 64, 32, 48
    counts = _counts(E, R)
    a, b = torch.randn(R, I), torch.randn(E, I, O)
    offs = ops.offsets(counts)
    assert torch.equal(ops.grouped_mm(a, b, offs), grouped_mm_loop(a, b, offs))


def test_group_sums_and_empty_groups():
    counts = torch.tensor([0, 3, 0, 5])
    x = torch.randn(10, 6)
    x[8:] = float("nan")
    sums = ops.grouped_sum(x, ops.offsets(counts))
    expected = torch.stack([torch.zeros(6), x[0:3].sum(0), torch.zeros(6), x[3:8].sum(0)])
    assert torch.allclose(sums, expected)


def test_no_rows_at_all():
    out = ops.grouped_mm(torch.randn(0, 8), torch.randn(3, 8, 4), ops.offsets([0, 0, 0]))
    assert out.shape == (0, 4)


def test_opcheck_and_fullgraph_compile_in_fp32():
    """torch's own fake function accepts only bf16; ours takes fp32, so compile of an fp32 call works."""
    a, b, bias = torch.randn(20, 8), torch.randn(3, 8, 12), torch.randn(3, 12)
    offs = ops.offsets([4, 0, 9])
    torch.library.opcheck(torch.ops.moe_plugin.grouped_mm, (a, b, offs, bias),
                          test_utils=("test_schema", "test_faketensor"))
    compiled = torch.compile(lambda a, b, offs, bias: ops.grouped_mm(a, b, offs, bias) * 2, fullgraph=True)
    assert torch.equal(compiled(a, b, offs, bias), ops.grouped_mm(a, b, offs, bias) * 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_cpu_path_equals_torch_grouped_mm_bit_for_bit(dtype):
    """On CPU the op runs torch's own grouped-mm kernel into pooled memory: same bits as F.grouped_mm."""
    from moe_plugin.ops import native
    module, why = native.load()
    if module is None:
        pytest.skip(reason=f"native kernels unavailable: {why}")
    E, R, I, O = 5, 72, 32, 40
    counts = _counts(E, R - 8)
    offs = ops.offsets(counts)
    a, b, g = torch.randn(R, I, dtype=dtype), torch.randn(E, I, O, dtype=dtype), torch.randn(R, O, dtype=dtype)
    kept = int(counts.sum())
    assert torch.equal(module.grouped_mm(a, b, offs)[:kept], torch.nn.functional.grouped_mm(a, b, offs=offs)[:kept])
    assert torch.equal(module.grouped_mm(a.t(), g, offs), torch.nn.functional.grouped_mm(a.t(), g, offs=offs))
