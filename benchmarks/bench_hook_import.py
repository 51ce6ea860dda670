"""`python -c "import deepspeed"` with moe_plugin's DeepSpeed hook on and off (MOE_PLUGIN_DEEPSPEED_HOOK=0),
shuffled rounds; medians of wall and child CPU time.

    python benchmarks/bench_hook_import.py ROUNDS
"""
import os
import random
import resource
import statistics
import subprocess
import sys
import time

rounds = int(sys.argv[1])
base = {k: v for k, v in os.environ.items() if k != "MOE_PLUGIN_DEEPSPEED_HOOK"}
base["OMP_NUM_THREADS"] = "1"
res = {"on": ([], []), "off": ([], [])}
for _ in range(rounds):
    for state in random.sample(["on", "off"], 2):
        env = base if state == "on" else {**base, "MOE_PLUGIN_DEEPSPEED_HOOK": "0"}
        b = resource.getrusage(resource.RUSAGE_CHILDREN); t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import deepspeed"], env=env, check=True, capture_output=True)
        res[state][0].append(time.perf_counter() - t)
        a = resource.getrusage(resource.RUSAGE_CHILDREN)
        res[state][1].append(a.ru_utime - b.ru_utime + a.ru_stime - b.ru_stime)
for i, name in enumerate(("wall", "cpu")):
    off = statistics.median(res["off"][i])
    on = statistics.median(res["on"][i])
    print(f"{name}: hook on {on:.2f} s, off {off:.2f} s, ratio {on / off:.3f}")
