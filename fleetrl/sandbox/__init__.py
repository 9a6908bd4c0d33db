"""Runs untrusted Python (a model's tool call, a code answer) in a separate, limited process (docs/envs.md).

A shared service of the layers above it: the `python` tool (envs/tools.py) and the `code` scorer (rewards/code.py)
both run code here. It imports nothing of fleetrl, and its bootstrap (_boot.py) nothing at all beyond the
standard library.
"""
from fleetrl.sandbox.runner import SandboxLimits, SandboxResult, run_python

__all__ = ["SandboxLimits", "SandboxResult", "run_python"]
