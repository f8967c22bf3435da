"""Adapters for RL frameworks that run their own loop (slime); see each module."""
