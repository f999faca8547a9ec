"""Planning a training run on paper: memory per device, communication per mesh axis, the
pipeline bubble and an estimated step time, tokens/s and MFU, for layouts and model sizes that
cannot run on the machine at hand (``python -m mff.recipes.plan``).

One job per module: :mod:`~mff.plan.devices` (the accelerator table), :mod:`~mff.plan.layout`
(the layout, checked with the run's rules), :mod:`~mff.plan.shards` (each param's shard per
device), :mod:`~mff.plan.activations` (activation bytes per layer), :mod:`~mff.plan.schedule`
(pipeline orders, micro-batches in flight, bubble), :mod:`~mff.plan.memory` (the peak per
device), :mod:`~mff.plan.comm` (bytes per axis and their time), :mod:`~mff.plan.estimate`
(step time, tokens/s, MFU), :mod:`~mff.plan.advice` (what to change when a layout does not
fit, and the bound below which no layout of a device count fits), :mod:`~mff.plan.build` (the
whole plan) and
:mod:`~mff.plan.report` (its text).
"""

from mff.plan.build import MAX_LAYERS, PlanDoesNotFit, check_config, make_plan
from mff.plan.devices import DEVICES, Device, get_device
from mff.plan.report import format_plan

__all__ = ["DEVICES", "MAX_LAYERS", "Device", "PlanDoesNotFit", "check_config", "format_plan", "get_device", "make_plan"]
