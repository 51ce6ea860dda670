"""The one-process fast path: where every expert is on this process, routing and experts run as few autograd nodes.

fused_route.py   the routing (scores, top-k, slots, gates, aux loss) as one autograd function
fused_experts.py gather, expert FFN and scatter of the routed rows as one autograd function (FusedMoE)
node_cpu.py      the whole step (both of the above) as one autograd node on CPU, native kernels
node_cuda.py     the same on CUDA in eager mode, the Triton kernels
"""
