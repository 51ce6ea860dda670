"""The Triton routing kernels against the torch reference (moe_plugin/ops/torch_ops.py): on CPU under
the Triton interpreter, and compiled on CUDA when a GPU is present.

triton reads TRITON_INTERPRET when it is imported (its own tl.sum and tl.cumsum are @triton.jit
functions), so one process runs either the interpreter or the compiler. A plain run of this file
runs the CUDA cases here and the same cases again under the interpreter in a child process.

Legend: T tokens, D model dim, E experts, K top-k, R routed rows.
"""
import importlib
import importlib.util
import random
import sys

import pytest
import torch

from moe_plugin.ops import torch_ops
from helpers.interpreter import INTERPRET, NO_TRITON, check_child_run, in_parent
from helpers.poison import poisoned_empty
from helpers.routes import random_slots

try:
    import triton
except ImportError:
    triton = None

# every test here runs again under the interpreter, in the child that test_interpreter_run starts
pytestmark = pytest.mark.interpreter

# (T, E, K, capacity): small capacities drop choices; T * K = 1200 takes two steps of the route scan
ROUTINGS = [(1, 1, 1, 1), (37, 5, 3, 6), (300, 8, 4, 100), (50, 16, 8, 30), (20, 4, 2, 0), (0, 4, 2, 3)]
# (T, E, K, capacity, D): D = 600 at K = 8 and D = 1300 at K = 3 take two D steps with a ragged end
SHAPES = [(1, 1, 1, 1, 1), (37, 5, 3, 6, 7), (13, 9, 8, 5, 129), (5, 8, 8, 8, 600), (11, 6, 3, 4, 1300),
          (20, 4, 2, 0, 5), (0, 4, 2, 3, 7)]
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
# fp16 / bf16 results are compared with the reference run in fp64 on the same values: within 2 ulps
TOLERANCES = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-5),
              torch.float16: (2 * torch.finfo(torch.float16).eps, 1e-4),
              torch.bfloat16: (2 * torch.finfo(torch.bfloat16).eps, 1e-4)}


@pytest.fixture(params=["interpreter"] if INTERPRET else ["cuda"])
def kernels(request, monkeypatch):
    """(kernel module, device), its outputs allocated full of poison so an unwritten element fails."""
    if triton is None:
        pytest.skip(reason=NO_TRITON)
    if not INTERPRET and not torch.cuda.is_available():
        pytest.skip(reason="no CUDA device for the compiled kernels (test_interpreter_run covers CPU)")
    module = importlib.import_module("moe_plugin.ops.triton_kernels")
    monkeypatch.setattr(module, "_empty", poisoned_empty)
    return module, "cpu" if INTERPRET else "cuda"


@in_parent
def test_interpreter_run(request):
    """Every kernel case of this file again, on CPU under TRITON_INTERPRET=1 (helpers.interpreter)."""
    if triton is None:
        pytest.skip(reason=NO_TRITON)
    import numpy   # the interpreter's own dependency
    if version(triton.__version__) < (3, 7) and version(numpy.__version__) >= (2, 4):
        pytest.skip(reason=f"triton {triton.__version__}'s interpreter cannot run under numpy {numpy.__version__} (it "
                           f"calls int() on 1-element arrays, which numpy 2.4 refuses): triton >= 3.7.1 or numpy < 2.4 "
                           f"runs it; torch 2.11 pins triton 3.6.0. The compiled kernels are unaffected")
    check_child_run(request)


def version(text):
    return tuple(int(n) for n in text.split(".")[:2])


def random_routing(T, E, K, capacity, prioritized, device):
    """Distinct experts per token, as top-k gives; rows packed by expert as the dispatcher packs them."""
    expert_TK, row_start_E, num_rows = random_slots(T, E, K, capacity)
    order_T = torch.randperm(T).to(device) if prioritized else None
    return expert_TK.to(device), order_T, row_start_E.to(device), num_rows


def random_pos(T, E, K, capacity, device):
    expert_TK, _, row_start_E, num_rows = random_routing(T, E, K, capacity, False, device)
    pos_TK, _ = torch_ops.route_slots(expert_TK, None, row_start_E, capacity, num_rows)
    return pos_TK, num_rows


def randn(*shape, dtype, device):
    return torch.randn(*shape).to(dtype=dtype, device=device)


def as_dtype(x, dtype):
    return None if x is None else x.to(dtype)


def reference_dtype(dtype):
    return dtype if dtype in (torch.float64, torch.float32) else torch.float64


def assert_matches(got, expected, dtype, summed=1):
    """summed: the products each element of a dot adds up. Against the fp64 reference an fp32 dot's rounding grows
    as eps * sqrt(summed) of its terms' size (seen: up to 1.3e-5 at 1,300 terms), so its atol grows so past 256."""
    assert got.dtype == dtype and got.shape == expected.shape and got.is_contiguous()
    rtol, atol = TOLERANCES[dtype]
    if dtype == torch.float32:
        atol *= max(1.0, (summed / 256) ** 0.5)
    torch.testing.assert_close(got.to(expected.dtype), expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("T, E, K, capacity", ROUTINGS)
@pytest.mark.parametrize("prioritized", [False, True])
def test_route_slots(kernels, T, E, K, capacity, prioritized):
    module, device = kernels
    args = random_routing(T, E, K, capacity, prioritized, device)
    pos_TK, token_R = module.route_slots(*args[:3], capacity, args[3])
    expected_pos_TK, expected_token_R = torch_ops.route_slots(*args[:3], capacity, args[3])
    assert torch.equal(pos_TK, expected_pos_TK) and torch.equal(token_R, expected_token_R)


@pytest.mark.parametrize("T, E, K, capacity, D", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_optional", [True, False], ids=["scale_other", "plain"])
def test_scatter_rows(kernels, T, E, K, capacity, D, dtype, with_optional):
    module, device = kernels
    pos_TK, R = random_pos(T, E, K, capacity, device)
    src_TD = randn(T, D, dtype=dtype, device=device)
    scale_TK = randn(T, K, dtype=dtype, device=device) if with_optional else None
    other_RD = randn(R, D, dtype=dtype, device=device) if with_optional else None
    out_RD, dot_TK = module.scatter_rows(src_TD, pos_TK, scale_TK, other_RD, R)
    ref = torch.float64
    expected_RD, expected_dot_TK = torch_ops.scatter_rows(
        src_TD.to(ref), pos_TK, as_dtype(scale_TK, ref), as_dtype(other_RD, ref), R)
    assert_matches(out_RD, expected_RD, dtype)
    assert_matches(dot_TK, expected_dot_TK, dtype, summed=D)


@pytest.mark.parametrize("T, E, K, capacity, D", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_optional", [True, False], ids=["scale_other", "plain"])
def test_gather_sum(kernels, T, E, K, capacity, D, dtype, with_optional):
    module, device = kernels
    pos_TK, R = random_pos(T, E, K, capacity, device)
    src_RD = randn(R, D, dtype=dtype, device=device)
    scale_TK = randn(T, K, dtype=dtype, device=device) if with_optional else None
    other_TD = randn(T, D, dtype=dtype, device=device) if with_optional else None
    out_TD, dot_TK = module.gather_sum(src_RD, pos_TK, scale_TK, other_TD)
    ref = torch.float64
    expected_TD, expected_dot_TK = torch_ops.gather_sum(
        src_RD.to(ref), pos_TK, as_dtype(scale_TK, ref), as_dtype(other_TD, ref))
    assert_matches(out_TD, expected_TD, dtype)
    assert_matches(dot_TK, expected_dot_TK, dtype, summed=D)


def test_dropped_choices_contribute_nothing(kernels):
    """Scale and rows of dropped choices are never read: NaN there must not reach the outputs."""
    module, device = kernels
    T, E, K, capacity, D = 30, 4, 2, 5, 9
    pos_TK, R = random_pos(T, E, K, capacity, device)
    dropped_TK = pos_TK < 0
    assert dropped_TK.any() and not dropped_TK.all()
    scale_TK = randn(T, K, dtype=torch.float32, device=device).masked_fill(dropped_TK, float("nan"))
    src_RD = randn(R, D, dtype=torch.float32, device=device)
    other_TD = randn(T, D, dtype=torch.float32, device=device)
    out_TD, dot_TK = module.gather_sum(src_RD, pos_TK, scale_TK, other_TD)
    assert not out_TD.isnan().any() and torch.all(dot_TK[dropped_TK] == 0)
    out_RD, dot_TK = module.scatter_rows(other_TD, pos_TK, scale_TK, src_RD, R)
    assert not out_RD.isnan().any() and torch.all(dot_TK[dropped_TK] == 0)


# (R, O, end): end at 0, inside the first or a later block of rows, at R; O over one block of columns
ZERO_TAILS = [(1, 1, 0), (1, 1, 1), (37, 5, 20), (37, 300, 16), (40, 7, 40), (0, 3, 0), (9, 513, 0)]


@pytest.mark.parametrize("R, O, end", ZERO_TAILS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_rows_past(kernels, R, O, end, dtype):
    module, device = kernels
    out_RO = randn(R, O, dtype=dtype, device=device)
    before_RO = out_RO.clone()
    module.zero_rows_past(out_RO, torch.tensor(end, device=device, dtype=torch.int32))
    assert torch.equal(out_RO[:end], before_RO[:end]) and torch.all(out_RO[end:] == 0)


# (group sizes, tail rows past the last group, O): empty groups, one row, ragged ends over a block of rows
GROUP_SUMS = [([1], 0, 1), ([0, 5, 0, 17], 3, 9), ([33, 1, 40], 0, 300), ([0, 0], 4, 7), ([16, 16], 0, 16)]


@pytest.mark.parametrize("sizes, tail, O", GROUP_SUMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grouped_sum(kernels, sizes, tail, O, dtype):
    module, device = kernels
    x_RO = randn(sum(sizes) + tail, O, dtype=dtype, device=device)
    offs_E = torch.tensor(sizes).cumsum(0).to(device=device, dtype=torch.int32)
    sums_EO = module.grouped_sum(x_RO, offs_E)
    x_ref_RO = x_RO.to(reference_dtype(dtype))
    expected_EO = torch.stack([block.sum(0) for block in x_ref_RO[:sum(sizes)].split(sizes)])
    assert_matches(sums_EO, expected_EO, dtype)


@pytest.mark.parametrize("sizes, tail, O", GROUP_SUMS + [([3, 0, 40, 1], 5, 1300)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_bias_dot_and_scale(kernels, sizes, tail, O, dtype):
    """dot_R += <grad_RO[r], bias_EO[expert of r]> and grad_RO *= scale_R1, in place, for the grouped rows (the rows past
    them untouched), against the same in fp64 on the same values: empty groups, a tail, O over two column blocks."""
    module, device = kernels
    R, E = sum(sizes) + tail, len(sizes)
    grad_RO, bias_EO = randn(R, O, dtype=dtype, device=device), randn(E, O, dtype=dtype, device=device)
    scale_R1 = torch.rand(R, 1).to(dtype=dtype, device=device)
    dot_R = randn(R, dtype=torch.float64 if dtype == torch.float64 else torch.float32, device=device)
    offs_E = torch.tensor(sizes).cumsum(0).to(device=device, dtype=torch.int32)
    wide = [t.to(torch.float64) for t in (grad_RO, bias_EO, scale_R1, dot_R)]
    expert_R = torch.repeat_interleave(torch.arange(E), torch.tensor(sizes)).to(device)
    G = sum(sizes)
    expected_dot_R, expected_RO = wide[3].clone(), wide[0].clone()
    expected_dot_R[:G] += (wide[0][:G] * wide[1][expert_R]).sum(1)
    expected_RO[:G] *= wide[2][:G]
    module.bias_dot_and_scale_(grad_RO, bias_EO, offs_E, scale_R1, dot_R)
    assert_matches(grad_RO, expected_RO, dtype)
    torch.testing.assert_close(dot_R.to(torch.float64), expected_dot_R, rtol=1e-5, atol=1e-4 * max(1, O / 256) ** 0.5)
    assert torch.equal(grad_RO[G:].to(torch.float64), wide[0][G:]) and torch.equal(dot_R[G:].to(torch.float64),
                                                                                  wide[3][G:])


# (R, H): H = 1 and odd widths, H = 1300 over two blocks of columns, no rows
SWIGLU_SHAPES = [(1, 1), (7, 13), (150, 13), (37, 200), (3, 1300), (0, 4)]   # several rows a program, or one
# (limit, alpha, beta): SwiGLU clamped at a limit, and gpt-oss's form
CLAMPS = [(0.5, 1.0, 0.0), (0.7, 1.702, 1.0)]


@pytest.mark.parametrize("R, H", SWIGLU_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("clamp", [None] + CLAMPS, ids=["plain", "clamped", "gpt_oss"])
def test_swiglu(kernels, R, H, dtype, clamp):
    """Forward and backward against torch_ops run in fp64 on the same values; with a clamp, some inputs
    sit exactly on the limits (torch.clamp passes the gradient there)."""
    module, device = kernels
    pre_RH2 = randn(R, 2 * H, dtype=dtype, device=device)
    if clamp is not None and R * H > 1:
        pre_RH2.view(-1)[:2] = torch.tensor([clamp[0], -clamp[0]], dtype=dtype)
    grad_RH = randn(R, H, dtype=dtype, device=device)
    ref = reference_dtype(dtype)
    if clamp is None:
        act_RH = module.swiglu_forward(pre_RH2)
        grad_pre_RH2, act_again_RH = module.swiglu_backward(grad_RH, pre_RH2)
        expected_act_RH = torch_ops.swiglu_forward(pre_RH2.to(ref))
        expected_grad_RH2, _ = torch_ops.swiglu_backward(grad_RH.to(ref), pre_RH2.to(ref))
    else:
        act_RH = module.clamped_swiglu_forward(pre_RH2, *clamp)
        grad_pre_RH2, act_again_RH = module.clamped_swiglu_backward(grad_RH, pre_RH2, *clamp)
        expected_act_RH = torch_ops.clamped_swiglu_forward(pre_RH2.to(ref), *clamp)
        expected_grad_RH2, _ = torch_ops.clamped_swiglu_backward(grad_RH.to(ref), pre_RH2.to(ref), *clamp)
    assert_matches(act_RH, expected_act_RH, dtype)
    assert_matches(act_again_RH, expected_act_RH, dtype)
    assert_matches(grad_pre_RH2, expected_grad_RH2, dtype)


@pytest.mark.parametrize("R, H", SWIGLU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("clamp", [None] + CLAMPS, ids=["plain", "clamped", "gpt_oss"])
@pytest.mark.parametrize("scale_act", [False, True], ids=["act", "scaled_act"])
def test_swiglu_backward_scaled(kernels, R, H, dtype, clamp, scale_act):
    """The lean backward's one pass: scale * grad of pre, the activations (times the scale with scale_act) and
    <grad, act> per row (fp32, of the unscaled activations), against torch_ops in fp64 on the same values."""
    module, device = kernels
    pre_RH2 = randn(R, 2 * H, dtype=dtype, device=device)
    grad_RH = randn(R, H, dtype=dtype, device=device)
    scale_R1 = torch.rand(R, 1).to(dtype=dtype, device=device)
    grad_pre_RH2, act_RH, dot_R = module.swiglu_backward_scaled(grad_RH, pre_RH2, scale_R1, clamp, scale_act)
    wide = [t.to(torch.float64) for t in (grad_RH, pre_RH2)]
    if clamp is None:
        expected_grad_RH2, expected_act_RH = torch_ops.swiglu_backward(*wide)
    else:
        expected_grad_RH2, expected_act_RH = torch_ops.clamped_swiglu_backward(*wide, *clamp)
    assert_matches(act_RH, expected_act_RH * scale_R1.to(torch.float64) if scale_act else expected_act_RH, dtype)
    assert_matches(grad_pre_RH2, expected_grad_RH2 * scale_R1.to(torch.float64), dtype)
    expected_dot_R = (wide[0] * expected_act_RH).sum(1)
    assert dot_R.dtype == torch.float32
    torch.testing.assert_close(dot_R.to(torch.float64), expected_dot_R, rtol=1e-5, atol=1e-5)


def test_zero_tokens_launch_nothing(monkeypatch):
    if triton is None:
        pytest.skip(reason=NO_TRITON)
    module = importlib.import_module("moe_plugin.ops.triton_kernels")
    for name in ("_route_slots_kernel", "_scatter_rows_kernel", "_gather_sum_kernel", "_zero_rows_past_kernel",
                 "_grouped_sum_kernel", "_swiglu_kernel"):
        monkeypatch.setattr(module, name, None)     # a launch would fail on None[grid]
    expert_TK = torch.zeros(0, 3, dtype=torch.long)
    pos_TK, token_R = module.route_slots(expert_TK, None, torch.zeros(4, dtype=torch.long), 2, 0)
    assert pos_TK.shape == (0, 3) and token_R.shape == (0,)
    out_RD, dot_TK = module.scatter_rows(torch.zeros(0, 5), pos_TK, None, torch.zeros(0, 5), 0)
    assert out_RD.shape == (0, 5) and dot_TK.shape == (0, 3)
    out_TD, dot_TK = module.gather_sum(torch.zeros(0, 5), pos_TK, None, None)
    assert out_TD.shape == (0, 5) and dot_TK.shape == (0,)
    module.zero_rows_past(torch.zeros(0, 5), torch.tensor(0))
    assert module.swiglu_forward(torch.zeros(0, 8)).shape == (0, 4)
    assert module.grouped_sum(torch.zeros(0, 5), torch.zeros(0, dtype=torch.int32)).shape == (0, 5)


def test_available_says_why_not():
    if triton is None:
        pytest.skip(reason=NO_TRITON)
    ok, reason = importlib.import_module("moe_plugin.ops.triton_kernels").available()
    assert ok == torch.cuda.is_available() and (ok or "CUDA" in reason)


def test_imports_without_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)    # makes `import triton` raise ImportError
    monkeypatch.setitem(sys.modules, "triton.language", None)
    path = torch_ops.__file__.replace("torch_ops.py", "triton_kernels.py")
    spec = importlib.util.spec_from_file_location("_triton_kernels_without_triton", path)
    module = importlib.util.module_from_spec(spec)     # a fresh copy, imported without triton
    spec.loader.exec_module(module)
    ok, reason = module.available()
    assert not ok and "pip install triton" in reason
    pos_TK = torch.zeros(2, 1, dtype=torch.long)
    calls = [lambda: module.route_slots(pos_TK, None, torch.zeros(1, dtype=torch.long), 2, 2),
             lambda: module.scatter_rows(torch.ones(2, 3), pos_TK, None, None, 2),
             lambda: module.gather_sum(torch.ones(2, 3), pos_TK, None, None)]
    for call in calls:
        with pytest.raises(ImportError, match="pip install triton"):
            call()


def test_host_side_cdiv_and_next_power_of_2_are_tritons():
    """The launchers' plain-Python cdiv and next_power_of_2 (Triton's own cost 2 us a host call) agree with Triton's."""
    if triton is None:
        pytest.skip(reason=NO_TRITON)
    from moe_plugin.ops.triton_kernels import cdiv, next_power_of_2
    for n in [*range(0, 130), 1000, 1023, 1024, 1025, 2 ** 20 + 1, random.randrange(1, 2 ** 40)]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for b in (1, 3, 16, 32, 64):
            assert cdiv(n, b) == triton.cdiv(n, b), (n, b)
