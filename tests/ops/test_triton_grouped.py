"""The fused grouped-GEMM Triton kernels (moe_plugin/ops/triton_grouped.py) against their torch references
(torch_grouped.py), on fresh random inputs: on CPU under the Triton interpreter (a child process, as
test_triton_kernels.py does), compiled on CUDA when a GPU is present.

Legend: T tokens, D model dim, N hidden width, F first projection width, E experts, K top-k, R routed rows.
"""
import pytest
import torch

from moe_plugin.ops import torch_grouped, torch_ops
from helpers.interpreter import INTERPRET, NO_TRITON, check_child_run, in_child, in_parent
from helpers.routes import random_slots

try:
    import triton
except ImportError:
    triton = None

# every test here runs again under the interpreter, in the child that test_interpreter_run starts
pytestmark = pytest.mark.interpreter

# (T, E, K, capacity, D, N): k = 1 and k > 2, empty experts (T*K < E), one expert taking every row, dropped
# choices, odd D and N; D = 37 takes three K steps of 16 with a ragged end, N = 21 two N tiles
ROUTINGS = {"k1": (13, 4, 1, 13, 8, 5), "k3_empty_experts": (2, 9, 3, 2, 7, 3),
            "one_expert_all_rows": (23, 1, 1, 23, 37, 21), "k4_dropping_odd": (11, 6, 4, 5, 19, 9),
            "no_tokens": (0, 3, 2, 1, 5, 4)}


def routed(T, E, K, capacity, device):
    """pos_TK and R of a top-k routing with distinct experts per token, rows packed by expert; offs_E."""
    expert_TK, row_start_E, R = random_slots(T, E, K, capacity)
    pos_TK, _ = torch_ops.route_slots(expert_TK, None, row_start_E, capacity, R)
    kept_E = torch.bincount(expert_TK.reshape(-1)[pos_TK.reshape(-1) >= 0], minlength=E)
    return pos_TK.to(device), R, kept_E.cumsum(0).to(device=device, dtype=torch.int32)


@pytest.fixture(params=["interpreter"] if INTERPRET else ["cuda"])
def device(request):
    if triton is None:
        pytest.skip(reason=NO_TRITON)
    if not INTERPRET and not torch.cuda.is_available():
        pytest.skip(reason="no CUDA device for the compiled kernels (test_interpreter_run covers CPU)")
    return "cpu" if INTERPRET else "cuda"


@in_parent
def test_interpreter_run(request):
    """Every kernel case of this file again, on CPU under TRITON_INTERPRET=1 (helpers.interpreter)."""
    check_child_run(request)


@pytest.mark.parametrize("case", sorted(ROUTINGS))
@pytest.mark.parametrize("activation", torch_grouped.GATHER_UP_ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_gather_up(device, case, activation, dtype, bias):
    """Activations and saved pre-activations against the reference in fp64 on the same values (bf16: within
    its rounding of the fp32 accumulator); rows past the last expert's are 0."""
    from moe_plugin.ops import triton_grouped
    T, E, K, capacity, D, N = ROUTINGS[case]
    pos_TK, R, offs_E = routed(T, E, K, capacity, device)
    R += 3                                          # rows past the kept ones, as a fixed capacity leaves
    F = 2 * N if activation != "relu" else N
    x_TD = torch.randn(T, D, device=device).to(dtype)
    w1_EDF = (torch.randn(E, D, F, device=device) / D ** 0.5).to(dtype)
    b1_EF = torch.randn(E, F, device=device).to(dtype) if bias else None
    token_R = torch_grouped.tokens_of_rows(pos_TK, R)
    act_RN, saved = triton_grouped.gather_up(x_TD, token_R, offs_E, w1_EDF, b1_EF, activation)
    wide = torch.float64
    expected_RN, expected_saved = torch_grouped.gather_up(
        x_TD.to(wide), token_R, offs_E, w1_EDF.to(wide), None if b1_EF is None else b1_EF.to(wide), activation)
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (2 * torch.finfo(dtype).eps, 1e-2)
    for got, want in ((act_RN, expected_RN), (saved, expected_saved)):
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.to(wide), want, rtol=rtol, atol=atol)
    kept = int(offs_E[-1]) if E else 0
    assert torch.all(act_RN[kept:] == 0) and torch.all(saved[kept:] == 0)


def test_tokens_of_rows():
    pos_TK = torch.tensor([[0, -1], [2, 1], [-1, 3]])
    assert torch_grouped.tokens_of_rows(pos_TK, 5).tolist() == [0, 1, 1, 2, 0]


def test_gather_up_reference_matches_the_unfused_path():
    """The reference itself: gather, grouped GEMM with bias, activations.activate, all in fp64."""
    from moe_plugin import ops
    from moe_plugin.activations import activate
    pos_TK, R, offs_E = routed(17, 5, 3, 8, "cpu")
    x_TD = torch.randn(17, 6, dtype=torch.float64)
    for activation, F in (("relu", 7), ("swiglu", 14), ("geglu", 14)):
        w1_EDF, b1_EF = torch.randn(5, 6, F, dtype=torch.float64), torch.randn(5, F, dtype=torch.float64)
        token_R = torch_grouped.tokens_of_rows(pos_TK, R)
        act_RN, saved = torch_grouped.gather_up(x_TD, token_R, offs_E, w1_EDF, b1_EF, activation)
        x_RD = ops.scatter_rows(x_TD, pos_TK, None, None, R)[0]
        expected_RN, expected_saved = activate(ops.grouped_mm(x_RD, w1_EDF, offs_E, b1_EF), activation)
        torch.testing.assert_close(act_RN, expected_RN, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(saved, expected_saved, rtol=1e-12, atol=1e-12)


# ---- the choice: the fused layer takes gather_up on the CUDA path only where it measured faster ----------------

def fused_layer_step(activation, bias, dtype=torch.float32, hf_layout=False, frozen_w1=False):
    """Output and gradients (x, gate, weights) of FusedMoE on a small routing with dropped choices. hf_layout: w1 a
    transposed view of [E, F, D] weights (Hugging Face's experts); frozen_w1: w1 needs no gradient."""
    from moe_plugin import MoEConfig
    from moe_plugin.experts import Experts
    from moe_plugin.one_process.fused_experts import FusedMoE
    T, E, K, capacity, D, H = 19, 5, 3, 9, 11, 7
    torch.manual_seed(5)
    experts = Experts(MoEConfig(model_dim=D, hidden_size=H, num_experts=E, top_k=K, activation=activation,
                                bias=bias))
    pos_TK, R, offs_E = routed(T, E, K, capacity, "cpu")
    x_TD = torch.randn(T, D).to(dtype).requires_grad_()
    gate_TK = torch.rand(T, K).to(dtype).requires_grad_()
    weights = [None if w is None else w.detach().to(dtype) for w in (experts.w1_EDH, experts.b1_EH, experts.w2_EHD,
                                                                        experts.b2_ED)]
    if hf_layout:
        weights[0] = weights[0].transpose(1, 2).contiguous().transpose(1, 2)
    for w in weights:
        if w is not None:
            w.requires_grad_(w is not weights[0] or not frozen_w1)
    y_TD = FusedMoE.apply(x_TD, gate_TK, pos_TK, offs_E, experts.activation, *weights)
    params = [x_TD, gate_TK] + [w for w in weights if w is not None and w.requires_grad]
    return [y_TD] + list(torch.autograd.grad(y_TD.float().square().sum(), params))


@in_child
@pytest.mark.parametrize("fused_wins", [True, False], ids=["fused_faster", "unfused_faster"])
@pytest.mark.parametrize("activation, bias", [("swiglu", False), ("relu", True), ("geglu", True)])
def test_layer_takes_gather_up_only_where_measured_faster(monkeypatch, fused_wins, activation, bias):
    """Timed once per shape (then cached), the fused kernels (gather_up; dgrad_swiglu for SwiGLU) run only when they
    won; the layer's outputs and gradients (the gate's among them) equal today's CPU path either way."""
    from moe_plugin.ops import choice, fused_gemms, triton_grouped
    expected = fused_layer_step(activation, bias)      # CPU: today's path
    timed, calls = [], []
    monkeypatch.setattr(fused_gemms, "_FASTER", {})
    monkeypatch.setattr(fused_gemms, "seconds", lambda run, device: timed.append(run) or
                        (1.0 if (run.__name__ == "fused") == fused_wins else 2.0))
    real = triton_grouped.gather_up
    monkeypatch.setattr(triton_grouped, "gather_up", lambda *args: calls.append(args) or real(*args))
    with choice.simulated_cuda():
        for _ in range(2):
            got = fused_layer_step(activation, bias)
            for a, b in zip(got, expected):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # gather_up; in backward dgrad_swiglu for plain SwiGLU, and wgrad_gather
    chosen = {"gather_up", "wgrad_gather"} | ({"dgrad_swiglu"} if activation == "swiglu" else set())
    assert len(timed) == 2 * len(chosen) and len(calls) == (2 if fused_wins else 0)
    assert set(key[0] for key in fused_gemms._FASTER) == chosen


def test_cpu_runs_todays_path():
    from moe_plugin.ops import fused_gemms
    pos_TK, R, offs_E = routed(5, 3, 2, 5, "cpu")
    assert fused_gemms.gather_up(torch.randn(5, 4), pos_TK, offs_E, "swiglu", torch.randn(3, 4, 6), None) is None


@pytest.mark.parametrize("case", sorted(ROUTINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dgrad_swiglu(device, case, dtype):
    """The down projection's dgrad with SwiGLU's backward, the gate scale and the gate gradient's row sums in its
    epilogue, against the reference in fp64 on the same values; rows past the last expert's 0."""
    from moe_plugin.ops import triton_grouped
    T, E, K, capacity, D, H = ROUTINGS[case]
    pos_TK, R, offs_E = routed(T, E, K, capacity, device)
    R += 3
    grad_RD = torch.randn(R, D, device=device).to(dtype)
    w2_EHD = (torch.randn(E, H, D, device=device) / H ** 0.5).to(dtype)
    pre_RH2 = torch.randn(R, 2 * H, device=device).to(dtype)
    scale_R1 = torch.rand(R, 1, device=device).to(dtype)
    got = triton_grouped.dgrad_swiglu(grad_RD, offs_E, w2_EHD, pre_RH2, scale_R1)
    wide = torch.float64
    expected = torch_grouped.dgrad_swiglu(grad_RD.to(wide), offs_E, w2_EHD.to(wide), pre_RH2.to(wide),
                                          scale_R1.to(wide))
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (2 * torch.finfo(dtype).eps, 1e-2)
    for name, a, b in zip(("grad_pre", "act"), got[:2], expected[:2]):
        assert a.dtype == dtype and a.shape == b.shape, name
        torch.testing.assert_close(a.to(wide), b, rtol=rtol, atol=atol, msg=name)
    assert got[2].dtype == torch.float32
    torch.testing.assert_close(got[2].to(wide), expected[2], rtol=1e-4, atol=1e-4)
    kept = int(offs_E[-1]) if E else 0
    assert torch.all(got[0][kept:] == 0) and torch.all(got[1][kept:] == 0) and torch.all(got[2][kept:] == 0)


def test_dgrad_swiglu_reference_is_the_lean_backward():
    """The reference's pieces against autograd on the expert output: grad_pre is the (gate-scaled) gradient of the
    pre-activation, and dot_R the gradient of <grad, y> with respect to each row's gate."""
    pos_TK, R, offs_E = routed(13, 4, 2, 13, "cpu")
    H, D = 5, 6
    pre_RH2 = torch.randn(R, 2 * H, dtype=torch.float64, requires_grad=True)
    w2_EHD = torch.randn(4, H, D, dtype=torch.float64)
    grad_RD = torch.randn(R, D, dtype=torch.float64)
    scale_R = torch.rand(R, dtype=torch.float64, requires_grad=True)
    act_RH = torch.nn.functional.silu(pre_RH2[:, :H]) * pre_RH2[:, H:]
    ends = offs_E.tolist()
    blocks = [act_RH[start:end] @ w2_EHD[e] for e, (start, end) in enumerate(zip([0] + ends[:-1], ends))]
    y_RD = torch.cat(blocks + [act_RH.new_zeros(R - ends[-1], D)]) * scale_R[:, None]
    grad_pre, grad_scale = torch.autograd.grad((y_RD * grad_RD).sum(), [pre_RH2, scale_R])
    got_pre, got_act, got_dot = torch_grouped.dgrad_swiglu(grad_RD, offs_E, w2_EHD, pre_RH2.detach(),
                                                           scale_R.detach()[:, None])
    torch.testing.assert_close(got_pre, grad_pre)
    torch.testing.assert_close(got_act, act_RH.detach())
    torch.testing.assert_close(got_dot, grad_scale)


# ---- wgrad_gather: the first projection's weight gradient reading x's routed rows by index ------------------------

@pytest.mark.parametrize("case", sorted(ROUTINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias, hf_layout", [(True, False), (False, False), (True, True)],
                         ids=["bias", "no_bias", "hf_layout_bias"])
def test_wgrad_gather(device, case, dtype, bias, hf_layout):
    """[E, D, F] weight gradient and [E, F] bias gradient against the reference in fp64 on the same values (bf16:
    within its rounding of the fp32 accumulator); empty experts give 0; the gradient is laid out as the weight is;
    the rows past the last expert's (random here) are not read."""
    from moe_plugin.ops import triton_grouped
    T, E, K, capacity, D, F = ROUTINGS[case]
    pos_TK, R, offs_E = routed(T, E, K, capacity, device)
    R += 3
    x_TD = torch.randn(T, D, device=device).to(dtype)
    grad_RF = torch.randn(R, F, device=device).to(dtype)
    w1_EDF = torch.randn(E, F, D, device=device).to(dtype).transpose(1, 2) if hf_layout else \
        torch.randn(E, D, F, device=device).to(dtype)
    token_R = torch_grouped.tokens_of_rows(pos_TK, R)
    grad_w_EDF, grad_b_EF = triton_grouped.wgrad_gather(x_TD, token_R, offs_E, grad_RF, w1_EDF, bias)
    wide = torch.float64
    expected_w, expected_b = torch_grouped.wgrad_gather(x_TD.to(wide), token_R, offs_E, grad_RF.to(wide), bias)
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (2 * torch.finfo(dtype).eps, 1e-2)
    assert grad_w_EDF.dtype == dtype and grad_w_EDF.shape == (E, D, F) and grad_w_EDF.stride() == w1_EDF.stride()
    torch.testing.assert_close(grad_w_EDF.to(wide), expected_w, rtol=rtol, atol=atol)
    if bias:
        assert grad_b_EF.dtype == dtype and grad_b_EF.shape == (E, F)
        torch.testing.assert_close(grad_b_EF.to(wide), expected_b, rtol=rtol, atol=atol)
    else:
        assert grad_b_EF is None
    ends = offs_E.tolist()
    for e, (start, end) in enumerate(zip([0] + ends[:-1], ends)):
        if end == start:
            assert torch.all(grad_w_EDF[e] == 0) and (not bias or torch.all(grad_b_EF[e] == 0))


def test_wgrad_gather_zero_model_dim(device):
    """D = 0: an empty weight gradient, and still the bias gradient's column sums."""
    from moe_plugin.ops import triton_grouped
    pos_TK, R, offs_E = routed(9, 4, 2, 9, device)
    x_TD, grad_RF = torch.randn(9, 0, device=device), torch.randn(R, 5, device=device)
    token_R = torch_grouped.tokens_of_rows(pos_TK, R)
    grad_w_EDF, grad_b_EF = triton_grouped.wgrad_gather(x_TD, token_R, offs_E, grad_RF,
                                                        torch.empty(4, 0, 5, device=device), True)
    assert grad_w_EDF.shape == (4, 0, 5)
    expected_b = torch_grouped.wgrad_gather(x_TD.double(), token_R, offs_E, grad_RF.double(), True)[1]
    torch.testing.assert_close(grad_b_EF.double(), expected_b, rtol=1e-5, atol=1e-5)


@in_child
def test_wgrad_gather_gpu_tiles(device, monkeypatch):
    """Each tile size the GPU's autotuner may pick (several tiles per dim, several row steps, ragged ends) gives the
    reference's gradients."""
    from moe_plugin.ops import triton_grouped
    pos_TK, R, offs_E = routed(50, 3, 2, 50, "cpu")
    D, F = 150, 131
    x_TD, grad_RF = torch.randn(50, D), torch.randn(R, F)
    token_R = torch_grouped.tokens_of_rows(pos_TK, R)
    expected_w, expected_b = torch_grouped.wgrad_gather(x_TD.double(), token_R, offs_E, grad_RF.double(), True)
    for block_m, block_n, block_k, _, _ in triton_grouped._WGRAD_CONFIGS:
        monkeypatch.setattr(triton_grouped, "_blocks", lambda: (block_m, block_n, block_k))
        got_w, got_b = triton_grouped.wgrad_gather(x_TD, token_R, offs_E, grad_RF, torch.empty(3, D, F), True)
        torch.testing.assert_close(got_w.double(), expected_w, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_b.double(), expected_b, rtol=1e-5, atol=1e-5)


def test_wgrad_gather_reference_is_the_weight_gradient():
    """The reference against autograd of the gathered rows' per-expert GEMM with bias, in fp64."""
    pos_TK, R, offs_E = routed(15, 5, 3, 6, "cpu")
    D, F = 6, 9
    x_TD = torch.randn(15, D, dtype=torch.float64)
    w_EDF = torch.randn(5, D, F, dtype=torch.float64, requires_grad=True)
    b_EF = torch.randn(5, F, dtype=torch.float64, requires_grad=True)
    grad_RF = torch.randn(R, F, dtype=torch.float64)
    token_R = torch_grouped.tokens_of_rows(pos_TK, R)
    ends = offs_E.tolist()
    y_RF = torch.cat([x_TD[token_R[start:end].long()] @ w_EDF[e] + b_EF[e]
                      for e, (start, end) in enumerate(zip([0] + ends[:-1], ends))])
    grad_w, grad_b = torch.autograd.grad((y_RF * grad_RF[:ends[-1]]).sum(), [w_EDF, b_EF])
    got_w, got_b = torch_grouped.wgrad_gather(x_TD, token_R, offs_E, grad_RF, True)
    torch.testing.assert_close(got_w, grad_w)
    torch.testing.assert_close(got_b, grad_b)


@in_child
@pytest.mark.parametrize("activation, bias, dtype, hf_layout, frozen_w1", [
    ("swiglu", False, torch.float32, False, False), ("relu", True, torch.float32, True, False),
    ("geglu", True, torch.bfloat16, False, False), ("relu", True, torch.float32, False, True)],
    ids=["swiglu_fp32", "relu_bias_hf_layout", "geglu_bias_bf16", "frozen_w1"])
def test_layer_backward_with_wgrad_gather_forced_on(device, monkeypatch, activation, bias, dtype, hf_layout,
                                                    frozen_w1):
    """The fused layer's backward with wgrad_gather forced on (the other fused kernels off) gives today's outputs
    and gradients; it runs once per step where w1 needs a gradient, never where w1 is frozen."""
    from moe_plugin.ops import choice, fused_gemms, triton_grouped
    expected = fused_layer_step(activation, bias, dtype, hf_layout, frozen_w1)      # CPU: today's path
    calls = []
    monkeypatch.setattr(fused_gemms, "measured_faster", lambda key, *args: key[0] == "wgrad_gather")
    real = triton_grouped.wgrad_gather
    monkeypatch.setattr(triton_grouped, "wgrad_gather", lambda *args: calls.append(args) or real(*args))
    with choice.simulated_cuda():
        got = fused_layer_step(activation, bias, dtype, hf_layout, frozen_w1)
    assert len(calls) == (0 if frozen_w1 else 1)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, **tolerance)
