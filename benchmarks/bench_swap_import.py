"""What importing DeepSpeed added to every Hugging Face swap while swap_moe_blocks built DeepSpeed's block class
whenever DeepSpeed was installed (issue 31, item 5; it now builds HFMoEBlock and imports nothing of DeepSpeed).

Each fresh process times A = importing the transformers adapter and swapping a tiny Mixtral (a swap now), then
B = importing integrations/deepspeed/hf.py (what the old default imported, DeepSpeed with it); now / before =
A / (A + B), per process, as CPU seconds (less sensitive to a busy machine) and wall seconds.

    OMP_NUM_THREADS=1 python benchmarks/bench_swap_import.py ROUNDS
"""
import json
import os
import statistics
import subprocess
import sys

CHILD = """
import json, time
c0, w0 = time.process_time(), time.perf_counter()
import moe_plugin.integrations.transformers as hf_moe
from transformers import MixtralConfig, MixtralForCausalLM
small = dict(vocab_size=61, hidden_size=40, intermediate_size=28, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, num_local_experts=6, num_experts_per_tok=3)
hf_moe.swap_moe_blocks(MixtralForCausalLM(MixtralConfig(**small)))
c1, w1 = time.process_time(), time.perf_counter()
import moe_plugin.integrations.deepspeed.hf
c2, w2 = time.process_time(), time.perf_counter()
print(json.dumps({"A_cpu": c1 - c0, "B_cpu": c2 - c1, "A_wall": w1 - w0, "B_wall": w2 - w1}))
"""

runs = []
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 5):
    done = subprocess.run([sys.executable, "-c", CHILD], check=True, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
for key in ("A_cpu", "B_cpu", "A_wall", "B_wall"):
    print(f"{key}: {' '.join(f'{r[key]:.2f}' for r in runs)}  median {statistics.median(r[key] for r in runs):.2f} s")
for kind in ("cpu", "wall"):
    ratios = [r[f"A_{kind}"] / (r[f"A_{kind}"] + r[f"B_{kind}"]) for r in runs]
    print(f"now / before ({kind}): {' '.join(f'{x:.3f}' for x in ratios)}  median {statistics.median(ratios):.3f}")
