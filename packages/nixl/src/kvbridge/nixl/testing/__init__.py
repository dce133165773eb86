"""Development tools around the transfer engine, not used at run time.

* :mod:`~kvbridge.nixl.testing.synthetic`: host-memory caches filled with verifiable content;
* :mod:`~kvbridge.nixl.testing.harness`: a prefill and a decode engine in real processes;
* :mod:`~kvbridge.nixl.testing.demo` and :mod:`~kvbridge.nixl.testing.bench`: the
  ``kvbridge demo`` and ``kvbridge bench`` commands;
* :mod:`~kvbridge.nixl.testing.memcpy`: the host memcpy baseline both commands report.
"""
