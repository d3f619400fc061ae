"""``python -m collsvc``: the same as the ``collsvc`` command."""

from __future__ import annotations

from collsvc.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
