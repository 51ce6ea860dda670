import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)                                   # fairseq_helpers
sys.path.insert(0, os.path.join(HERE, "..", "distributed"))  # launch.run_workers
