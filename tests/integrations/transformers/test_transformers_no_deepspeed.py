"""The transformers adapter never imports DeepSpeed (issue 31, item 5): with DeepSpeed installed, swap_moe_blocks and
upcycle build exactly HFMoEBlock, in a fresh interpreter that never loads deepspeed nor prints its accelerator
warning. DeepSpeed's paths make their own blocks: use_deepspeed_blocks (what its initialize and ZeRO-3 call) turns
the plain blocks into DeepSpeedHFMoEBlocks in place."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from helpers.hf import build_model, needs_transformers, tokens

pytestmark = [needs_transformers, pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                                     reason="only means something with deepspeed installed")]

SCRIPT = """
import json, sys
import moe_plugin.integrations.transformers as hf_moe
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM
small = dict(vocab_size=61, hidden_size=40, intermediate_size=28, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
swapped = hf_moe.swap_moe_blocks(MixtralForCausalLM(MixtralConfig(**small, num_local_experts=6, num_experts_per_tok=3)))
upcycled = hf_moe.upcycle(LlamaForCausalLM(LlamaConfig(**small)), num_experts=4, top_k=2)
blocks = [type(m) for model in (swapped, upcycled) for m in model.modules() if isinstance(m, hf_moe.HFMoEBlock)]
print(json.dumps({"blocks": [f"{b.__module__}.{b.__qualname__}" for b in blocks],
                  "deepspeed": sorted(m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed.")
                                      or m.startswith("moe_plugin.integrations.deepspeed"))}))
"""


def test_swap_and_upcycle_build_hf_blocks_without_importing_deepspeed():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["blocks"] == ["moe_plugin.integrations.transformers.block.HFMoEBlock"] * 4, result
    assert result["deepspeed"] == [], result
    assert "Setting accelerator" not in done.stderr + done.stdout, done.stderr[-3000:]


def test_deepspeed_s_paths_turn_plain_blocks_into_its_moe_layers_in_place():
    from deepspeed.moe.layer import MoE as NativeMoE

    from moe_plugin.integrations.deepspeed.hf import DeepSpeedHFMoEBlock, use_deepspeed_blocks
    from moe_plugin.integrations.transformers import HFMoEBlock, swap_moe_blocks
    model = swap_moe_blocks(build_model("qwen2_moe", seed=0))
    ids = tokens(seed=1)
    with torch.no_grad():
        before = model(ids).logits
    params = [(n, id(p)) for n, p in model.named_parameters()]
    plain = [m for m in model.modules() if isinstance(m, HFMoEBlock)]
    assert plain and all(type(m) is HFMoEBlock for m in plain)
    assert use_deepspeed_blocks(model) is model
    blocks = [m for m in model.modules() if isinstance(m, HFMoEBlock)]
    assert [id(m) for m in blocks] == [id(m) for m in plain]
    assert all(type(m) is DeepSpeedHFMoEBlock and isinstance(m, NativeMoE) for m in blocks)
    assert [(n, id(p)) for n, p in model.named_parameters()] == params
    assert all(not p.allreduce and p.group_name == "ep_size_1" for m in blocks for p in m.moe.experts.parameters())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    state = model.state_dict()   # DeepSpeed's per-expert names; they load back into a plain swap
    assert any(".deepspeed_moe.experts.deepspeed_experts.0." in k for k in state)
    other = use_deepspeed_blocks(swap_moe_blocks(build_model("qwen2_moe", seed=2)))
    other.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(other(ids).logits, before)
