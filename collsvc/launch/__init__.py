"""The launcher: ``collsvc run`` and everything only it uses.

- :mod:`collsvc.launch.launcher`: the supervision loop (start the ranks, copy their output, stop them all
  at the first failure, name the rank at fault).
- :mod:`collsvc.launch.spec`: what a run starts (``LaunchSpec``) and each rank's environment.
- :mod:`collsvc.launch.embedded_coordinator`: the coordinator a run serves itself, started while the ranks import.
- :mod:`collsvc.launch.join_relay`, :mod:`collsvc.launch.join_batch`: the ranks join in one coordinator call.
- :mod:`collsvc.launch.fork_server`, :mod:`collsvc.launch.forked_ranks`: a Python script's ranks forked from
  one process that loaded numpy, gRPC and collsvc once.
- :mod:`collsvc.launch.parent_watch`: a rank dies with its launcher.
- :mod:`collsvc.launch.rank_processes`: one rank process and its exit (also the benchmarks' ranks).
- :mod:`collsvc.launch.output`: the ranks' output lines, copied whole.

Nothing here is imported by ``import collsvc``; ``collsvc run`` starts its ranks before it loads gRPC,
protobuf or numpy, so this package's ``__init__`` imports nothing.
"""
