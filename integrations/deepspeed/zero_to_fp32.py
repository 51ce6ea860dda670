"""DeepSpeed's zero_to_fp32.py command line, for ZeRO-3 checkpoints whose experts are split over expert-data-parallel
groups as well (consolidate.py):

    python -m moe_plugin.integrations.deepspeed.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--safe_serialization]
"""
from moe_plugin.integrations.deepspeed.consolidate import main

if __name__ == "__main__":
    main()
