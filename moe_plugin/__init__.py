"""moe_plugin: a fast Mixture-of-Experts layer for PyTorch.

The shape legend of the data path (router -> plan -> dispatcher -> experts -> back): tensors carry their
dims as a suffix (x_TD is [tokens, model dim]); each letter means one thing in every file that points here.

The layer
    T  tokens (the input flattened to [T, D])
    D  model dim
    E  experts (E_local: one rank's)
    K  choices per token (top-k)
    R  routed rows: the kept (token, choice) pairs grouped by expert; T*K of them on one process
    H  expert hidden dim (one hidden slice's when experts are sliced over ranks)
    F  first projection's width: 2H with a gated activation ([gate | up]), else H (w1_EDH, b1_EH, the
       state dict's names, hold F columns)
    Q  LoRA rank
    C  capacity per expert (the padded [E, C, D] layout)
    I, O  in and out width of one grouped GEMM
    1  a dim of size 1

The router
    G  expert groups (group-limited routing)     M  experts per group
    N  sequences                                 S  tokens per sequence
    X  the choices of a sequence counted for the balance loss

The routing kernels
    A  (choice, token block) pairs, choice-major (a block is one token on CPU)
    B  token blocks

Expert parallelism
    W  ranks of the expert-parallel group (counts_WE[w, e]: the rows rank w routes to expert e)
    L  ranks per node                            U  nodes (W = U * L)
    V  ranks of one weight gather (the hidden slices of one compute slice; slices / r of them)
    P  ranks holding the same experts (the expert-data group, FSDP2)
    Z  segments of rows (all_to_all.ranges)
    J  expert slots of the ep group with replicas: every expert's owner and each copy, ordered by holder rank
    Y  with replicas, the expert copies one rank sends or receives (packed_Y: a row per copy, its weights flattened)

Not letters: r the parallel degree, d the overlap degree, an expert's hidden slices (ExpertLayout.slices),
and world_size the ranks of the whole world (W is one expert-parallel group's). Inside the Triton kernels
(ops/triton_*.py) M, N and K are a GEMM tile's rows, columns and reduction dim, Triton's convention.
"""
from .config import MoEConfig
from .layer import MoELayer, aux_loss
from .router import begin_step, update_expert_bias

__version__ = "0.1.0"
__all__ = ["MoEConfig", "MoELayer", "aux_loss", "begin_step", "update_expert_bias", "__version__"]
