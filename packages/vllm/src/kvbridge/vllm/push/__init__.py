"""Push mode: the decode engine allocates first, the prefill engine writes into its blocks.

:mod:`~kvbridge.vllm.push.scheduler` (the scheduler half), :mod:`~kvbridge.vllm.push.offers`
(its offer thread), :mod:`~kvbridge.vllm.push.worker` (the worker half) and
:mod:`~kvbridge.vllm.push.orders` (what one step orders).
"""
