"""Compute kernels: our C kernels for the CPU forward (``cpu_build``, ``cpu_packed``, ``cpu_calls`` +
``csrc/``) and the batched verifier (Triton kernel and its torch reference under one contract). Imports
nothing of the engine but ``engine.paths``, ``engine.config`` and the rule's constant in ``engine.acceptance``.
"""
