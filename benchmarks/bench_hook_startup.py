"""Python start-up with moe_plugin's DeepSpeed hook .pth active, turned off by its variable, and absent.

    python benchmarks/bench_hook_startup.py VENV_PYTHON SITE_PACKAGES ROUNDS
Runs `python -c pass` in the three states in a shuffled order each round (the .pth renamed away for "absent");
reports the median wall time and the median CPU time (user + system of the child, less sensitive to the load
of a shared machine), each with its ratio to "absent"."""
import os
import random
import resource
import statistics
import subprocess
import sys
import time

python, site, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
pth = os.path.join(site, "moe_plugin_deepspeed_hook.pth")
states = ["hook on", "MOE_PLUGIN_DEEPSPEED_HOOK=0", "no .pth"]
wall = {s: [] for s in states}
cpu = {s: [] for s in states}
base = {k: v for k, v in os.environ.items() if k != "MOE_PLUGIN_DEEPSPEED_HOOK"}


def run(state):
    env = {**base, "MOE_PLUGIN_DEEPSPEED_HOOK": "0"} if state == states[1] else base
    if state == states[2]:
        os.rename(pth, pth + ".away")
    try:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run([python, "-c", "pass"], env=env, check=True)
        wall[state].append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu[state].append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    finally:
        if state == states[2]:
            os.rename(pth + ".away", pth)


for _ in range(rounds):
    for state in random.sample(states, len(states)):
        run(state)
for name, values in (("wall", wall), ("cpu", cpu)):
    ref = statistics.median(values["no .pth"])
    for state in states:
        med = statistics.median(values[state])
        print(f"{name:4s} {state:28s} median {med * 1e3:7.2f} ms  ratio {med / ref:.3f}")
