"""Pull mode: the decode engine reads the prompt's blocks the prefill engine holds.

:mod:`~kvbridge.vllm.pull.scheduler` (the scheduler half), :mod:`~kvbridge.vllm.pull.worker`
(the worker half), :mod:`~kvbridge.vllm.pull.orders` (what one step orders) and
:mod:`~kvbridge.vllm.pull.source` (a decode request's source: tokens to load, checks).
"""
