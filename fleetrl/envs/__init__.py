"""Environments for multi-turn, tool-using rollouts (see docs/envs.md)."""
