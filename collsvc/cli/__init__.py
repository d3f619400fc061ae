"""The ``collsvc`` command line.

- :mod:`collsvc.cli.main`: the parser and ``main`` (the ``collsvc`` console script and ``python -m collsvc``).
- :mod:`collsvc.cli.remote`: ``coordinator``, ``status`` and ``health``, the subcommands that talk gRPC.
- :mod:`collsvc.cli.observe`: ``status --watch``, ``diagnose`` and ``timeline``.
- :mod:`collsvc.cli.common`: exit codes, the default coordinator, usage errors, token files.

This package's ``__init__`` imports nothing, so ``collsvc run`` pays only for :mod:`collsvc.cli.main`.
"""
