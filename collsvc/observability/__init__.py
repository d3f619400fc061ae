"""Observability: per-rank collective statistics, a Chrome-trace timeline, and flight-recorder diagnosis.

This package sits below the client, the server and the command line: they import it, it imports
none of them (only ``collsvc.errors``, ``collsvc.types`` and the generated protocol).

- :mod:`collsvc.observability.stats`: running totals per (op, group) that ride on heartbeats.
- :mod:`collsvc.observability.timeline`: per-rank trace parts and their merge into one trace.
- :mod:`collsvc.observability.recorder`: the hook the communicator calls at the start and end of a call.
- :mod:`collsvc.observability.diagnose`: what went wrong, from every rank's flight-recorder dump.
- :mod:`collsvc.observability.live`: the ``collsvc status --watch`` table.
- :mod:`collsvc.observability.render`: a PNG of a merged timeline (needs matplotlib).
"""

from __future__ import annotations
