"""``/metrics`` scraped during a real multi-process job and parsed with prometheus-client's parser."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import collsvc
from collsvc.observability.stats import SECONDS_BUCKETS, CollectiveStats, bus_bytes, call_bytes, keep_latest
from tests.cli._util import cli_env, run_cli
from tests.harness import coordinator, run_ranks

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "collsvc-dashboard.json"
FAST_HEARTBEAT = {"COLLSVC_HEARTBEAT_INTERVAL": "0.2", "COLLSVC_HOST": "metrics-host"}
FAMILIES = "#families"  # where scrape() lists the metric family names
SCRAPE_BOUND = 30.0  # seconds a rank polls /metrics for the totals its heartbeats carry


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample of ``/metrics``, by sample name."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        samples.setdefault(FAMILIES, []).append(({"name": family.name}, 0.0))  # also families without samples
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples


def value(samples: dict[str, Any], name: str, **labels: str) -> float | None:
    for found, number in samples.get(name, []):
        if all(found.get(k) == v for k, v in labels.items()):
            return float(number)
    return None


def job_under_scrape(comm: collsvc.Communicator, port: int, calls: int) -> dict[str, Any]:
    """Runs ``calls`` all_reduces and a barrier; rank 0 scrapes until every rank's totals arrived."""
    x = np.ones(1024, dtype=np.float32)
    for _ in range(calls):
        comm.all_reduce(x)
    comm.barrier()
    result: dict[str, Any] = {}
    if comm.rank == 0:
        job = comm.job.options.job_id
        deadline = time.monotonic() + SCRAPE_BOUND
        tick = threading.Event()
        while True:
            samples = scrape(port)
            counts = [
                value(samples, "collsvc_collectives_total", job=job, rank=str(r), op="all_reduce") for r in (0, 1)
            ]
            barriers = [value(samples, "collsvc_collectives_total", job=job, rank=str(r), op="barrier") for r in (0, 1)]
            if all(c == calls for c in counts) and all(barriers) or time.monotonic() > deadline:
                break
            tick.wait(0.2)  # the next heartbeat
        result = {"job": job, "samples": samples}
    comm.barrier()  # rank 1 stays in the job until rank 0 scraped
    return result


def test_metrics_scraped_during_a_job() -> None:
    calls = 5
    with coordinator(metrics_port=0) as (thread, address):
        assert thread.metrics_port
        outcome = run_ranks(
            job_under_scrape, 2, address=address, args=(thread.metrics_port, calls), env=FAST_HEARTBEAT, timeout=90
        )
    job, samples = outcome.values[0]["job"], outcome.values[0]["samples"]
    for rank in ("0", "1"):
        labels = {"job": job, "rank": rank, "host": "metrics-host", "op": "all_reduce", "group": "world"}
        assert value(samples, "collsvc_collectives_total", **labels) == calls
        assert value(samples, "collsvc_collective_bytes_total", **labels) == calls * 4096
        assert value(samples, "collsvc_collective_seconds_count", **labels) == calls
        assert value(samples, "collsvc_collective_seconds_bucket", le="+Inf", **labels) == calls
        assert value(samples, "collsvc_bus_bandwidth_bytes_per_second", **labels) > 0
        assert value(samples, "collsvc_heartbeat_age_seconds", job=job, rank=rank) is not None
    assert value(samples, "collsvc_job_members", job=job, state="alive") == 2
    assert value(samples, "collsvc_job_members", job=job, state="failed") == 0
    # Both ranks finished the first barrier. On one host it runs in shared memory: each rank counts it
    # as a collective (op "barrier"), not in the coordinator's barrier histogram.
    for rank in ("0", "1"):
        assert value(samples, "collsvc_collectives_total", job=job, rank=rank, op="barrier", group="world") >= 1
    assert value(samples, "collsvc_jobs") >= 1
    # Every series the Grafana dashboard queries is one the coordinator exports.
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    used = {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in re.findall(r"collsvc_\w+", " ".join(exprs))}
    families = {labels["name"] for labels, _ in samples[FAMILIES]}
    assert used and used <= families, used - families


def mismatched_job(comm: collsvc.Communicator, port: int) -> dict[str, Any]:
    """Rank 0 all_reduces while rank 1 all_gathers; rank 0 scrapes while rank 1 waits for it in the job."""
    x = np.ones(4)
    with contextlib.suppress(collsvc.CollectiveMismatchError):
        comm.all_reduce(x) if comm.rank == 0 else comm.all_gather(x)
    client = comm.job.store
    if comm.rank == 1:
        client.get("scraped", 30.0)  # stays a member until rank 0 scraped
        return {}
    samples = scrape(port)
    client.set("scraped", b"1")
    return {"job": comm.job.options.job_id, "samples": samples}


def test_failures_are_counted_by_kind() -> None:
    with coordinator(metrics_port=0) as (thread, address):
        outcome = run_ranks(mismatched_job, 2, address=address, args=(thread.metrics_port,), env=FAST_HEARTBEAT)
    job, samples = outcome.values[0]["job"], outcome.values[0]["samples"]
    assert value(samples, "collsvc_job_failures_total", job=job, kind="mismatch") == 1
    failed = value(samples, "collsvc_collectives_failed_total", job=job, rank="0", op="all_reduce")
    assert failed in (None, 1)  # present once a heartbeat carried it


def test_stats_totals_and_buckets() -> None:
    stats = CollectiveStats()
    stats.record("all_reduce", "world", 4096, 0.0003, bus_bytes("all_reduce", 4096, 4), True)
    stats.record("all_reduce", "world", 4096, 1000.0, 0.0, False)
    (entry,) = stats.snapshot()
    assert (entry.count, entry.failed, entry.bytes) == (2, 1, 8192)
    assert entry.bus_bytes == pytest.approx(4096 * 2 * 3 / 4)
    assert len(entry.bucket_counts) == len(SECONDS_BUCKETS) + 1
    assert entry.bucket_counts[SECONDS_BUCKETS.index(0.0005)] == 1 and entry.bucket_counts[-1] == 1
    table: dict[tuple[str, str], Any] = {}
    keep_latest(table, [entry])
    assert table[("all_reduce", "world")] is entry
    assert call_bytes("float64", (3, 4)) == 96 and call_bytes("", ()) == 0


def test_coordinator_command_serves_metrics_until_stopped() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "collsvc", "coordinator", "--port", "0", "--metrics-port", "0"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=cli_env(),
    )
    watchdog = threading.Timer(120.0, proc.kill)  # a hung daemon fails the test instead of hanging it
    watchdog.start()
    try:
        assert proc.stderr is not None
        lines = [proc.stderr.readline().decode(), proc.stderr.readline().decode()]
        found = re.fullmatch(r"collsvc coordinator metrics on http://127\.0\.0\.1:(\d+)/metrics\n", lines[0])
        assert found and "listening on 127.0.0.1:" in lines[1], lines
        port = int(found.group(1))
        samples = scrape(port)
        assert value(samples, "collsvc_jobs") == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()
    with pytest.raises(OSError):  # the endpoint stopped with the coordinator
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)


def test_bad_metrics_port_is_a_usage_error() -> None:
    result = run_cli("coordinator", "--port", "0", "--metrics-port", "70000")
    assert result.returncode == 2 and "--metrics-port must be in [0, 65535]" in result.stderr
