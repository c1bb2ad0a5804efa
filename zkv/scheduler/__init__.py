"""Scheduler side: pure bookkeeping over block ids (no torch, no cupy)."""
