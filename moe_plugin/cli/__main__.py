"""`python -m moe_plugin.cli` (torchrun -m moe_plugin.cli) runs the `moe-plugin` command."""
import sys

from .main import main

sys.exit(main())
