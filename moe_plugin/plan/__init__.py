"""`moe-plugin plan`: each rank's memory, all-to-all traffic and step time for a run at any world size, from the
run's own model code built on the meta device under torch.distributed's fake process group (no processes).

One file per job: fake_world.py (the fake process group), roles.py (ranks that hold the same), state_bytes.py
(parameter, gradient, optimizer and saved-activation bytes), traffic.py (collective bytes of a step),
step_time.py (the cost model's step time), devices.py (device profiles), experiment.py (a train experiment's
plan), report.py (text and JSON), command.py (the command line).
"""
from .command import add_arguments, main
from .assembly import Plan, Role
from .experiment import plan_experiment

__all__ = ["add_arguments", "main", "Plan", "Role", "plan_experiment"]
