"""The routing's observability: what the router did, per MoE layer and logging window, in every host's logs.

metrics.py   RoutingMonitor: hooks every MoELayer and sums its routing (expert load, drops, entropy, balance
             loss, the busiest expert-parallel rank) into one window's scalars
alarm.py     RoutingAlarm: an expert starved, or a layer dropping, for windows in a row
report.py    `moe-plugin checkpoint routing`: the routing of a saved `moe-plugin train` checkpoint on held-out data
"""
from .alarm import RoutingAlarm
from .metrics import RoutingMonitor, scalars

__all__ = ["RoutingAlarm", "RoutingMonitor", "scalars"]
