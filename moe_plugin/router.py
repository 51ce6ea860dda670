"""Router: scores, group-limited top-k choice with the balancing bias, gate normalization and scale,
load-balancing and z losses.

Shape legend: moe_plugin/__init__.py (here T tokens, D model dim, E experts, K top-k, G expert groups, M experts per
group, N sequences, S tokens per sequence, X the choices of a sequence counted for the balance loss).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.utils._pytree
import torch.nn.functional as F
from torch import nn

from .config import MoEConfig

COSINE_MAX_SCALE = 100.0


@dataclass
class Routes:
    scores_TE: torch.Tensor   # router probabilities (softmax/cosine) or sigmoid scores, fp32 when fp32_router
    expert_TK: torch.Tensor   # chosen experts, best first
    gate_TK: torch.Tensor     # scores of the chosen experts (normalized before drop if configured)
    aux_loss: torch.Tensor    # unweighted load-balancing loss
    z_loss: torch.Tensor      # unweighted router z-loss


# A pytree node, so that torch utilities that walk a module's output find its tensors: torch 2.11's FSDP2
# (a router sharded as a unit of its own) hooks its backward all-gather only on tensors tree_flatten finds.
torch.utils._pytree.register_dataclass(Routes)     # torch.export's imports torch._dynamo: a second per process


class Router(nn.Module):
    """Holds weight_ED (bias_E with router_bias, input_scale_D with router_norm, gate_scale_E with
    expert_gate_scale, log_scale for cosine), and the buffer expert_bias_E: fp32, added to the
    scores only to choose experts, and only when bias_routes: with balancing on (expert_bias_update_rate
    > 0), or when fixed_bias is set (a host model whose bias is one of its weights, DeepSeek-V3's
    e_score_correction_bias; set by the Hugging Face family). Otherwise the bias is never read. In
    training with expert_bias_update_rate > 0, every forward adds its choices per expert (before
    capacity drops) into .load_E, which update_expert_bias consumes.

    init_std: None draws weight_ED (and bias_E) uniform in +-1/sqrt(model_dim); a float draws both normal(0,
    init_std) (what Hugging Face's _init_weights gives its routers, gpt-oss's bias included; set by
    swap_moe_blocks).

    noise_policy: a host's router noise in training (NOISE_POLICIES; set by the DeepSpeed adapter).

    aux_loss_group: with aux_loss_scope "global", the processes whose tokens the balance loss counts (None: the
    world). Every process of it must run the layer's training forwards alike; a host whose layer lives on only some
    processes (a pipeline stage) sets the group of those. Once a host calls begin_step, the counts also span the
    optimizer step's micro-batches."""

    fixed_bias = False                    # class defaults: also for modules pickled before these existed
    init_std: Optional[float] = None
    noise_policy: Optional[str] = None    # a host's router noise in training (NOISE_POLICIES), set by its adapter
    aux_loss_group = None                 # aux_loss_scope "global": the processes counted (None: the world)
    spans_steps = False                   # set by begin_step: the global counts span an optimizer step
    step_counts: Optional["StepCounts"] = None       # with spans_steps: the step's counts so far (else None)

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.projector = nn.Linear(config.model_dim, config.router_proj_dim) if config.router_proj_dim else None
        self.weight_ED = nn.Parameter(torch.empty(config.num_experts, config.router_proj_dim or config.model_dim))
        if config.router == "cosine":
            self.log_scale = nn.Parameter(torch.empty(()))
        self.bias_E = nn.Parameter(torch.empty(config.num_experts)) if config.router_bias else None
        self.input_scale_D = nn.Parameter(torch.empty(config.model_dim)) if config.router_norm else None
        self.gate_scale_E = nn.Parameter(torch.empty(config.num_experts)) if config.expert_gate_scale else None
        self.register_buffer("expert_bias_E", torch.zeros(config.num_experts, dtype=torch.float32))
        self.load_E: Optional[torch.Tensor] = None   # a plain attribute: DDP must not broadcast it
        self.register_load_state_dict_pre_hook(_zero_bias_when_missing)
        self.reset_parameters()

    @property
    def bias_routes(self) -> bool:
        return self.fixed_bias or self.config.expert_bias_update_rate > 0

    def reset_parameters(self) -> None:
        """Draws the weights as construction does (after building on the meta device and to_empty); the bias 0."""
        bound = 1.0 / math.sqrt(self.config.model_dim)
        with torch.no_grad():
            if self.init_std is None:
                self.weight_ED.uniform_(-bound, bound)
            else:
                self.weight_ED.normal_(0.0, self.init_std)
            if self.bias_E is not None and self.init_std is None:
                self.bias_E.uniform_(-bound, bound)
            elif self.bias_E is not None:
                self.bias_E.normal_(0.0, self.init_std)
            for scale in (self.input_scale_D, self.gate_scale_E):
                if scale is not None:
                    scale.fill_(1.0)
            if self.config.router == "cosine":
                self.log_scale.fill_(math.log(10.0))
            if self.projector is not None:
                self.projector.reset_parameters()
            self.expert_bias_E.zero_()
        self.load_E = None

    def _apply(self, fn, recurse=True):
        """Casts (layer.double(), .to(bfloat16)) move the bias but keep it fp32, values intact."""
        bias_E = self.expert_bias_E
        super()._apply(fn, recurse)
        if self.expert_bias_E.dtype != torch.float32:
            self.expert_bias_E = bias_E.to(device=self.expert_bias_E.device, dtype=torch.float32)
        return self

    def logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        if self.input_scale_D is not None:
            x_TD = self._normed(x_TD)
        if self.config.fp32_router:    # in fp32 under autocast too: routes must not flip with rounding
            dtype = torch.promote_types(x_TD.dtype, torch.float32)
            with autocast_off(x_TD.device.type):
                return self._logits(x_TD.to(dtype), self.weight_ED.to(dtype),
                                    None if self.bias_E is None else self.bias_E.to(dtype))
        return self._logits(x_TD, self.weight_ED, self.bias_E)

    def _normed(self, x_TD: torch.Tensor) -> torch.Tensor:
        """router_norm: RMS-normalized in fp32 (no weight), back in x's dtype, times input_scale_D and D ** -0.5."""
        x32_TD = x_TD.to(torch.promote_types(x_TD.dtype, torch.float32))
        normed_TD = x32_TD * torch.pow(x32_TD.pow(2).mean(-1, keepdim=True) + self.config.router_norm_eps, -0.5)
        return normed_TD.to(x_TD.dtype) * self.input_scale_D * self.config.model_dim ** -0.5

    def _logits(self, x_TD: torch.Tensor, weight_ED: torch.Tensor, bias_E: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        if self.config.router == "cosine":
            if self.projector is not None:
                x_TD = F.linear(x_TD, self.projector.weight.to(x_TD.dtype), self.projector.bias.to(x_TD.dtype))
            scale = self.log_scale.clamp(max=math.log(COSINE_MAX_SCALE)).exp()
            return F.normalize(x_TD, dim=-1) @ F.normalize(weight_ED, dim=-1).t() * scale.to(x_TD.dtype)
        return x_TD @ weight_ED.t() if bias_E is None else F.linear(x_TD, weight_ED, bias_E)

    def scores(self, logits_TE: torch.Tensor) -> torch.Tensor:
        if self.config.router == "sigmoid":
            return torch.sigmoid(logits_TE)
        if self.config.router == "sqrt_softplus":
            return F.softplus(logits_TE).sqrt()
        return torch.softmax(logits_TE, dim=-1)

    def forward(self, x_TD: torch.Tensor, seq_len: Optional[int] = None,
                sequence_T: Optional[torch.Tensor] = None) -> Routes:
        """For aux_loss "seq": seq_len tokens per sequence (None: all of x_TD is one sequence), or
        sequence_T, each token's sequence index (sequences of different lengths)."""
        cfg = self.config
        noise = self.noise_policy if self.training else None
        if noise == "jitter":
            x_TD = multiplicative_jitter(x_TD, fp32=cfg.fp32_router)
        logits_TE = clean_TE = self.logits(x_TD)
        if self.training and cfg.gate_noise > 0 and cfg.gate_noise_kind == "tutel":
            logits_TE = logits_TE + cfg.gate_noise * torch.randn_like(logits_TE) / cfg.num_experts
        scores_TE = self.scores(logits_TE)
        probs_TE = scores_TE
        if cfg.router in ("sigmoid", "sqrt_softplus"):   # scores that do not sum to 1: normalized for the aux loss
            probs_TE = scores_TE / scores_TE.sum(-1, keepdim=True).clamp(min=torch.finfo(scores_TE.dtype).tiny)

        if self.training and cfg.gate_noise > 0 and cfg.gate_noise_kind == "choice":
            choice_TE = self.scores(logits_TE.detach() + cfg.gate_noise * torch.randn_like(logits_TE))
        elif noise == "gumbel":
            choice_TE = self.scores(logits_TE.detach() + gumbel_noise(logits_TE))
        else:
            choice_TE = scores_TE.detach()
        if self.bias_routes:
            choice_TE = choice_TE + self.expert_bias_E
        if cfg.topk_groups < cfg.num_groups:
            choice_TE = best_groups_only(choice_TE, cfg.num_groups, cfg.topk_groups, cfg.group_score)
        expert_TK = torch.topk(choice_TE, cfg.top_k, dim=-1).indices
        gate_TK = scores_TE.gather(1, expert_TK)
        if cfg.normalize_gate == "before_drop":
            gate_TK = gate_TK / gate_TK.sum(-1, keepdim=True).clamp(min=torch.finfo(gate_TK.dtype).tiny)
        if self.gate_scale_E is not None:
            gate_TK = gate_TK * self.gate_scale_E[expert_TK]
        if self.training and cfg.expert_bias_update_rate > 0:
            self._count(expert_TK)

        if cfg.aux_loss == "load_importance":
            aux = load_importance_loss(self.scores(clean_TE), logits_TE.gather(1, expert_TK[:, -1:]),
                                       cfg.gate_noise / cfg.num_experts)
        elif counts_globally(self):
            if self.spans_steps and cfg.aux_loss != "seq" and self.step_counts is None:
                self.step_counts = StepCounts()
            aux = global_balance_loss(cfg.aux_loss, probs_TE, expert_TK, cfg.num_experts, seq_len, sequence_T,
                                      self.aux_loss_group, self.step_counts)
        else:
            aux = balance_loss(cfg.aux_loss, probs_TE, expert_TK, cfg.num_experts, seq_len, sequence_T)
        z = z_loss(logits_TE) if cfg.z_loss_coef > 0 else logits_TE.new_zeros(())
        return Routes(scores_TE, expert_TK, gate_TK, aux, z)

    @property
    def step_counts_E1(self) -> Optional[torch.Tensor]:
        """With spans_steps: the counts of this optimizer step's micro-batches so far (else None)."""
        return None if self.step_counts is None else self.step_counts.total_E1

    def _count(self, expert_TK: torch.Tensor) -> None:
        if self.load_E is None or self.load_E.device != expert_TK.device:
            load_E = torch.zeros(self.config.num_experts, dtype=torch.long, device=expert_TK.device)
            self.load_E = load_E if self.load_E is None else load_E + self.load_E.to(expert_TK.device)
        flat = expert_TK.reshape(-1)
        self.load_E.scatter_add_(0, flat, torch.ones_like(flat))

    def take_load(self) -> torch.Tensor:
        """The choices per expert counted since the last call (int64, on the bias's device); clears them."""
        load_E = self.load_E
        self.load_E = None
        if load_E is None:
            return torch.zeros(self.config.num_experts, dtype=torch.long, device=self.expert_bias_E.device)
        return load_E.to(self.expert_bias_E.device)

    @torch.no_grad()
    def update_bias(self, load_E: torch.Tensor) -> None:
        """bias_e += rate * sign(mean load - load_e); compared as sum - E * load_e, exact in integers."""
        below_E = torch.sign(load_E.sum() - self.config.num_experts * load_E)
        self.expert_bias_E.add_(below_E.to(torch.float32), alpha=self.config.expert_bias_update_rate)


# Router noise policies a host adapter may set (Router.noise_policy), in training only:
#   "jitter": the router input times uniform noise in [1 - JITTER, 1 + JITTER] (Switch Transformer; DeepSpeed's
#             noisy_gate_policy "Jitter"): gates and choices both see it;
#   "gumbel": experts chosen on the logits plus Gumbel(0, 1) noise, the gates from the clean scores
#             (DeepSpeed's "RSample"; top-1 it samples an expert from the softmax).
# Both draw as torch.distributions does, so a host drawing the same way from the same RNG state routes alike.
NOISE_POLICIES = ("jitter", "gumbel")
JITTER = 1e-2


def multiplicative_jitter(x_TD: torch.Tensor, fp32: bool = True) -> torch.Tensor:
    """x_TD (in fp32 at least, with fp32) times noise drawn uniform in [1 - JITTER, 1 + JITTER], in fp32."""
    if fp32:
        x_TD = x_TD.to(torch.promote_types(x_TD.dtype, torch.float32))
    low, high = (torch.tensor(bound, device=x_TD.device) for bound in (1.0 - JITTER, 1.0 + JITTER))
    return x_TD * torch.distributions.Uniform(low, high).rsample(x_TD.shape).to(x_TD.dtype)


def gumbel_noise(logits_TE: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise of logits' shape (drawn in fp32), in logits' dtype."""
    zero, one = (torch.tensor(v, device=logits_TE.device) for v in (0.0, 1.0))
    return torch.distributions.Gumbel(zero, one).rsample(logits_TE.shape).to(logits_TE.dtype)


def _zero_bias_when_missing(module, state_dict, prefix, *args) -> None:
    """State dicts written before the bias existed load with a zero bias (which changes no choice)."""
    state_dict.setdefault(prefix + "expert_bias_E", torch.zeros_like(module.expert_bias_E))


def best_groups_only(choice_TE: torch.Tensor, num_groups: int, topk_groups: int,
                     group_score: str = "top2_sum") -> torch.Tensor:
    """choice_TE with -inf outside each token's topk_groups best groups of consecutive experts.

    A group scores the sum of its two best choice scores (its best when it has one expert), or with
    group_score "max" its best."""
    T, E = choice_TE.shape
    choice_TGM = choice_TE.view(T, num_groups, E // num_groups)
    best = 1 if group_score == "max" else min(2, E // num_groups)
    group_TG = choice_TGM.topk(best, dim=-1).values.sum(-1)
    best_TG = group_TG.topk(topk_groups, dim=-1).indices
    outside_TG = torch.ones_like(group_TG, dtype=torch.bool).scatter_(1, best_TG, False)
    return choice_TGM.masked_fill(outside_TG.unsqueeze(-1), -math.inf).view(T, E)


def autocast_available(device_type: str) -> bool:
    return torch.amp.is_autocast_available(device_type)


# What @torch.compiler.assume_constant_result does (torch 2.11's dynamo cannot trace is_autocast_available; 2.13's
# can), without its import of torch._dynamo: a second per process that imports the layer. A test holds it equal.
autocast_available._dynamo_marked_constant = True


def autocast_on(device_type: str) -> bool:
    return autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def autocast_off(device_type: str):
    """A context without autocast for device_type (nothing to do for devices autocast does not know)."""
    if autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def finalize_gates(gate_TK: torch.Tensor, kept_TK: torch.Tensor, normalize: str, scale: float = 1.0) -> torch.Tensor:
    """Zero the gates of dropped choices; renormalize over the kept ones for "after_drop"; times scale."""
    gate_TK = gate_TK * kept_TK.to(gate_TK.dtype)
    if normalize == "after_drop":
        gate_TK = gate_TK / gate_TK.sum(-1, keepdim=True).clamp(min=torch.finfo(gate_TK.dtype).eps)
    return gate_TK * scale if scale != 1.0 else gate_TK


def _choices_per_expert(expert_NX: torch.Tensor, num_experts: int, dtype) -> torch.Tensor:
    """[N, E]: how many of each row's entries name each expert (scatter_add: no host synchronization)."""
    counts_NE = torch.zeros(expert_NX.shape[0], num_experts, dtype=dtype, device=expert_NX.device)
    return counts_NE.scatter_add_(1, expert_NX, torch.ones_like(expert_NX, dtype=dtype))


def balance_loss(kind: str, probs_TE: torch.Tensor, expert_TK: torch.Tensor, num_experts: int,
                 seq_len: Optional[int] = None, sequence_T: Optional[torch.Tensor] = None) -> torch.Tensor:
    """E * sum_e(mean router probability of e * fraction of choices routed to e); 1.0 when balanced.

    gshard counts each token's first choice only; switch counts all top-k choices; seq is switch
    within each sequence of seq_len tokens (None: one sequence), or of the tokens sharing a
    sequence_T index, averaged over the (non-empty) sequences."""
    T, K = expert_TK.shape
    if kind == "none" or T == 0:
        return probs_TE.new_zeros(())
    if kind == "seq" and sequence_T is not None:
        return _ragged_sequence_loss(probs_TE, expert_TK, num_experts, sequence_T)
    counted_NX = expert_TK[:, :1].reshape(1, -1) if kind == "gshard" else expert_TK.reshape(1, -1)
    probs_NSE = probs_TE.unsqueeze(0)
    if kind == "seq" and seq_len is not None:
        counted_NX = expert_TK.reshape(-1, seq_len * K)
        probs_NSE = probs_TE.view(-1, seq_len, num_experts)
    fraction_NE = _choices_per_expert(counted_NX, num_experts, probs_TE.dtype) / counted_NX.shape[1]
    return num_experts * (probs_NSE.mean(1) * fraction_NE).sum(-1).mean()


def _ragged_sequence_loss(probs_TE, expert_TK, num_experts, sequence_T):
    """The seq loss over sequences of any lengths (indices below T; unused ones are empty and skipped)."""
    total, count = _ragged_sequence_terms(probs_TE, expert_TK, num_experts, sequence_T)
    return total / count


def _ragged_sequence_terms(probs_TE, expert_TK, num_experts, sequence_T):
    """(the sum of the non-empty sequences' seq-loss terms, how many there are)."""
    T, K = expert_TK.shape
    length_N = torch.zeros(T, dtype=probs_TE.dtype, device=probs_TE.device).index_add_(
        0, sequence_T, torch.ones_like(sequence_T, dtype=probs_TE.dtype))
    probs_NE = probs_TE.new_zeros(T, num_experts).index_add(0, sequence_T, probs_TE)
    choices_NE = probs_TE.new_zeros(T * num_experts).index_add_(
        0, (sequence_T[:, None] * num_experts + expert_TK).reshape(-1),
        probs_TE.new_ones(T * K)).view(T, num_experts)
    per_N = (probs_NE * choices_NE).sum(-1) / (length_N.square() * K).clamp(min=1)
    return num_experts * per_N.sum(), (length_N > 0).sum()


def counts_globally(router: "Router") -> bool:
    """Whether this forward's balance loss counts over every process of router.aux_loss_group (aux_loss_scope
    "global", a gshard, switch or seq loss that weighs in, training, more than one process); else it is the local
    one (which it equals on one process)."""
    cfg = router.config
    if not (cfg.aux_loss_scope == "global" and cfg.aux_loss in ("gshard", "switch", "seq") and cfg.aux_loss_coef > 0
            and router.training):
        return False
    return (router.spans_steps and cfg.aux_loss != "seq") or _several_processes(router.aux_loss_group)


def _several_processes(group) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


class StepCounts:
    """An optimizer step's expert counts so far, over the processes (the last entry their tokens), for one layer's
    global balance loss; begin_step starts a new one. A forward recomputed during backward (activation
    checkpointing) weighs by the counts its first forward did, though later micro-batches' forwards may have run in
    between (a pipeline's 1F1B schedule), and adds nothing: each first forward keeps its own counts and the counts
    it weighed by until its recompute, found by its own counts (one host synchronization per recompute)."""

    def __init__(self):
        self.total_E1: Optional[torch.Tensor] = None
        self._forwards: list = []             # per first forward not yet recomputed: (its counts, the counts it used)

    def join(self, counts_E1: torch.Tensor) -> torch.Tensor:
        """This forward's counts joined with the step's: the counts its balance loss weighs by."""
        if torch._C._current_graph_task_id() >= 0:           # a recompute during backward
            return self._first_forward_of(counts_E1)
        self.total_E1 = counts_E1 if self.total_E1 is None else self.total_E1 + counts_E1
        self._forwards.append((counts_E1, self.total_E1))
        return self.total_E1

    def _first_forward_of(self, counts_E1: torch.Tensor) -> torch.Tensor:
        if self._forwards:
            same_F = (torch.stack([own_E1 for own_E1, _ in self._forwards]) == counts_E1).all(1)
            same = same_F.nonzero().tolist()
            if same:
                return self._forwards.pop(same[0][0])[1]
        # a forward not seen since begin_step (its step began after it): it joins the counts so far
        return counts_E1 if self.total_E1 is None else self.total_E1


def begin_step(model: nn.Module) -> int:
    """Marks the start of an optimizer step for the layers of model with aux_loss_scope "global": from here until
    the next call, their gshard and switch losses count the expert frequencies over this step's micro-batches so
    far (and over the processes). Micro-batch i of a step then weighs its routing probabilities by the choices of
    micro-batches 1..i; the step's last micro-batch by the whole step's, as one process on the step's tokens
    would. Exact for every micro-batch, only the last, because each micro-batch's gradient is taken before the
    later ones are routed (Megatron-core's global_aux_loss counts the same way). Hosts call it: DeepSpeed's
    engine.step, HF Trainer (the ExpertBiasUpdate callback), fairseq's update count. Without a call each
    micro-batch counts its own tokens. Returns how many layers now span their steps."""
    routers = [m for m in model.modules() if isinstance(m, Router) and m.config.aux_loss_scope == "global"]
    for router in routers:
        router.spans_steps, router.step_counts = True, None
    return len(routers)


def global_balance_loss(kind: str, probs_TE: torch.Tensor, expert_TK: torch.Tensor, num_experts: int,
                        seq_len: Optional[int] = None, sequence_T: Optional[torch.Tensor] = None,
                        group=None, step: Optional["StepCounts"] = None) -> torch.Tensor:
    """This process's share of the balance loss counted over every process of group (default: the world): one
    all_reduce of the counts (no gradient through them); every process of group must call it.

    step (gshard, switch): the counts of the optimizer step's earlier micro-batches over the processes, which this
    forward's join (StepCounts.join): C_e and T_all below count them too, except the mean probability's T_all.

    gshard, switch: E * sum_e(P * this process's probability sum of e / T_all * C_e / (T_all * K')) with C_e the
    choices of e counted over all processes, T_all their tokens, P the processes, K' 1 (gshard) or K (switch).
    seq: P * the sum of this process's sequences' terms / N_all, the sequences of all processes. Its mean over the
    processes is the loss of one process on all their tokens together, and so is the mean of its gradients (as
    data parallelism averages them), whatever each process's share of the tokens."""
    T, K = expert_TK.shape
    P = dist.get_world_size(group) if _several_processes(group) else 1
    if kind == "seq":
        if sequence_T is not None:
            total, count = _ragged_sequence_terms(probs_TE, expert_TK, num_experts, sequence_T)
        elif T == 0:
            total, count = probs_TE.new_zeros(()), 0
        else:
            rows = T // seq_len if seq_len is not None else 1
            probs_NSE, counted_NX = probs_TE.view(rows, -1, num_experts), expert_TK.reshape(rows, -1)
            fraction_NE = _choices_per_expert(counted_NX, num_experts, probs_TE.dtype) / counted_NX.shape[1]
            total, count = num_experts * (probs_NSE.mean(1) * fraction_NE).sum(), rows
        count_1 = torch.as_tensor(count, dtype=torch.float64, device=probs_TE.device).reshape(1).clone()
        if P > 1:
            dist.all_reduce(count_1, group=group)
        return P * total / count_1[0].clamp(min=1).to(total.dtype)
    counted_TX = expert_TK[:, :1] if kind == "gshard" else expert_TK
    counts_E1 = torch.zeros(num_experts + 1, dtype=torch.float64, device=probs_TE.device)
    counts_E1.scatter_add_(0, counted_TX.reshape(-1), torch.ones(counted_TX.numel(), dtype=torch.float64,
                                                                  device=probs_TE.device))
    counts_E1[num_experts] = T
    if P > 1:
        dist.all_reduce(counts_E1, group=group)
    tokens = counts_E1[num_experts].clamp(min=1)
    if step is not None:
        counts_E1 = step.join(counts_E1)
    scale = num_experts * P / (tokens * counts_E1[num_experts].clamp(min=1) * counted_TX.shape[1])
    weights_E = (counts_E1[:num_experts] * scale).to(probs_TE.dtype)
    return (probs_TE.sum(0) * weights_E).sum()


def load_importance_loss(clean_TE: torch.Tensor, threshold_T1: torch.Tensor, noise_std: float) -> torch.Tensor:
    """Tutel's load_importance loss: the mean of the importance loss (the squared coefficient of variation of each
    expert's summed clean scores) and the load loss (of each expert's summed Normal(0, noise_std) CDF of its clean
    score minus the token's K-th noisy logit, threshold_T1), in fp32."""
    if clean_TE.shape[0] == 0:
        return clean_TE.new_zeros((), dtype=torch.float32)
    clean_TE = clean_TE.float()
    importance_E = clean_TE.sum(0)
    load_E = (0.5 * (1 + torch.erf((clean_TE - threshold_T1.float()) / noise_std / math.sqrt(2.0)))).sum(0)
    return sum(v.var() / (v.mean() ** 2 + 1e-10) for v in (importance_E, load_E)) / 2.0


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    if logits_TE.shape[0] == 0:
        return logits_TE.new_zeros(())
    return torch.logsumexp(logits_TE.to(torch.promote_types(logits_TE.dtype, torch.float32)), dim=-1).square().mean()


def update_expert_bias(model: nn.Module, group=None) -> int:
    """Auxiliary-loss-free balancing (DeepSeek-V3; Wang et al. 2024, arXiv 2408.15664), once per optimizer step:
    bias_e += rate * sign(mean load - load_e) in every MoE layer of model with
    expert_bias_update_rate > 0, from the choices counted since the last call (all micro-batches);
    clears the counts. Under torch.distributed the counts are first summed over `group` (default:
    every process), so every process keeps the same bias; every process must call it. Returns how
    many layers it updated (0 when none has the bias on). Adds no host synchronization."""
    routers = [m for m in model.modules() if isinstance(m, Router) and m.config.expert_bias_update_rate > 0]
    if not routers:
        return 0
    loads = [router.take_load() for router in routers]
    all_loads = torch.cat(loads)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(all_loads, group=group)
    for router, load_E in zip(routers, all_loads.split([load.numel() for load in loads])):
        router.update_bias(load_E)
    return len(routers)
