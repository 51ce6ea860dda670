#!/usr/bin/env bash
# The users' first GPU runs (issue 42), each checked: `moe-plugin train train.device=cuda train.steps=100` (the
# training loss falls by more than 1 nat, loss.png and expert_load.png written) and the DeepSpeed example's model
# with the bf16 config on one GPU (ep_size 1, torch's AdamW: DeepSpeed's fused Adam would be built first; the
# loss falls). Needs omegaconf and DeepSpeed (setup_peers.sh). Exit 0 only when both ran and their checks held.
#     bash benchmarks/gpu/first_runs.sh            # DEVICE=cpu STEPS=30 for a CPU smoke run of the first part
set -uo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
DEVICE="${DEVICE:-cuda}"
STEPS="${STEPS:-100}"
WORK="$(mktemp -d)"
rc=0

echo "== moe-plugin train train.device=$DEVICE train.steps=$STEPS"
if moe-plugin train train.device="$DEVICE" train.steps="$STEPS" log.out_dir="$WORK/train"; then
  "$PY" - "$WORK/train" <<'CHECK' || rc=1
import json
import pathlib
import sys
run = pathlib.Path(sys.argv[1])
losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
plots = [name for name in ("loss.png", "expert_load.png") if (run / name).is_file()]
ok = len(losses) >= 2 and losses[0] - losses[-1] > 1.0 and len(plots) == 2
print(f"first run: train loss {losses[0]:.3f} -> {losses[-1]:.3f}, plots {plots}: {'ok' if ok else 'FAILED'}")
sys.exit(0 if ok else 1)
CHECK
else
  rc=1
fi

if [ "$DEVICE" = cuda ]; then
  echo "== DeepSpeed example, configs/deepspeed/moe_tutel_gpu_bf16.json at ep_size 1"
  "$PY" -c "import json; c = json.load(open('configs/deepspeed/moe_tutel_gpu_bf16.json')); c['moe']['ep_size'] = 1; \
c['optimizer']['params']['torch_adam'] = True; json.dump(c, open('$WORK/ds.json', 'w'))"
  if torchrun --nproc_per_node 1 examples/deepspeed/train_moe.py --deepspeed_config "$WORK/ds.json" --steps 60 \
      | tee "$WORK/ds.log"; then
    "$PY" - "$WORK/ds.log" <<'CHECK' || rc=1
import re
import sys
losses = [float(v) for v in re.findall(r"^step \d+ loss ([0-9.]+)", open(sys.argv[1]).read(), re.M)]
ok = len(losses) >= 2 and losses[-1] < losses[0]
print(f"DeepSpeed example: loss {losses[0] if losses else None} -> {losses[-1] if losses else None}: "
      f"{'ok' if ok else 'FAILED'}")
sys.exit(0 if ok else 1)
CHECK
  else
    rc=1
  fi
fi
echo "first runs rc=$rc"
exit "$rc"
