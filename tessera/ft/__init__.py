"""Fault tolerance across replica groups, on torchft: `check` (torch-free: config, lighthouse, the group's files,
before any rank starts) and `replicas` (each step's quorum, gradient averaging, commit and live recovery)."""
