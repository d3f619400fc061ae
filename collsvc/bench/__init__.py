"""The benchmark harness behind ``collsvc bench``.

- :mod:`collsvc.bench.harness`: the command: an embedded coordinator, N rank processes, the table.
- :mod:`collsvc.bench.worker`: one rank (``python -m collsvc.bench.worker``).
- :mod:`collsvc.bench.protocol`: the timing protocol, shared with the gloo comparison in benchmarks/.
"""
