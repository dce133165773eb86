"""Development tools around the transfer engine, not used at run time.

* :mod:`~kvbridge.nixl.testing.synthetic`: host-memory caches filled with verifiable content;
* :mod:`~kvbridge.nixl.testing.harness`: a prefill and a decode engine in real processes
  (:mod:`~kvbridge.nixl.testing.child`: the loop each of those processes runs);
* :mod:`~kvbridge.nixl.testing.demo` and :mod:`~kvbridge.nixl.testing.bench`: the
  ``kvbridge demo`` and ``kvbridge bench`` commands, :mod:`~kvbridge.nixl.testing.scale`
  ``kvbridge bench --scale`` (with :mod:`~kvbridge.nixl.testing.svgplot` for its chart;
  :mod:`~kvbridge.nixl.testing.progress`: the progress lines on stderr);
* :mod:`~kvbridge.nixl.testing.memcpy`: the host memcpy baseline both commands report.
"""
