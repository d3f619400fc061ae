"""A picture of a merged timeline (``collsvc timeline render``): what Perfetto shows, as a small PNG.

One row per rank; each collective is a bar split into its phases (waiting for peers, moving data),
with a tick where the rank arrived. Needs matplotlib (``pip install 'collsvc[plot]'``).
"""

from __future__ import annotations

from typing import Any

PHASE_COLOURS = {"waiting for peers": "#f0a030", "moving data": "#3070c0"}
ARRIVAL_COLOUR = "#202020"


def render_png(trace: dict[str, Any], path: str, *, start_ms: float | None = None, end_ms: float | None = None) -> int:
    """Draws ``trace`` (a merged timeline) between ``start_ms`` and ``end_ms`` into the PNG ``path``.

    Returns:
        The number of collectives drawn.

    Raises:
        RuntimeError: matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise RuntimeError("rendering needs matplotlib: pip install 'collsvc[plot]'") from None
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    rows = {pid: index for index, pid in enumerate(sorted(names))}
    low = -float("inf") if start_ms is None else start_ms * 1000
    high = float("inf") if end_ms is None else end_ms * 1000

    def shown(event: dict[str, Any]) -> bool:
        return bool(low <= event["ts"] and event["ts"] + event.get("dur", 0) <= high)

    fig, ax = plt.subplots(figsize=(9, 0.7 * len(rows) + 1.3))
    drawn = 0
    for event in events:
        if event.get("pid") not in rows or "ts" not in event or not shown(event):
            continue
        y = rows[event["pid"]]
        if event.get("ph") == "X" and event["name"] in PHASE_COLOURS:
            ax.barh(y, event["dur"] / 1000, left=event["ts"] / 1000, height=0.5, color=PHASE_COLOURS[event["name"]])
        elif event.get("ph") == "X":
            drawn += 1
            ax.barh(y, event["dur"] / 1000, left=event["ts"] / 1000, height=0.62, fill=False, linewidth=0.6)
            if event["dur"] > 0:
                label = f"{event['name']} #{event['args']['seq']}"
                ax.text(event["ts"] / 1000, y - 0.34, label, fontsize=6, va="bottom")
        elif event.get("ph") == "i":
            ax.plot([event["ts"] / 1000] * 2, [y - 0.36, y + 0.36], color=ARRIVAL_COLOUR, linewidth=1.2)
    ax.set_yticks(list(rows.values()), [names[pid] for pid in rows])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.grid(True, axis="x", alpha=0.3)
    handles = [Patch(color=c, label=n) for n, c in PHASE_COLOURS.items()]
    handles.append(Patch(color=ARRIVAL_COLOUR, label="arrival"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=3, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return drawn
