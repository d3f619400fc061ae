"""Every COLLSVC_* value init reads is checked where it is read: the error names the variable and the range."""

from __future__ import annotations

import pytest

from collsvc.config import elastic_reform_timeout, resolve_init
from collsvc.options import InitOptions

BASE = {"COLLSVC_COORDINATOR": "c:1", "COLLSVC_WORLD_SIZE": "2"}


def resolve(extra: dict[str, str]) -> InitOptions:
    return resolve_init(None, None, None, "auto", 10.0, None, None, env={**BASE, **extra})


@pytest.mark.parametrize(
    ("name", "value", "range_text"),
    [
        ("COLLSVC_HEARTBEAT_INTERVAL", "0", "[0.01, 60]"),
        ("COLLSVC_HEARTBEAT_INTERVAL", "-1", "[0.01, 60]"),
        ("COLLSVC_HEARTBEAT_INTERVAL", "abc", "[0.01, 60]"),
        ("COLLSVC_HEARTBEAT_INTERVAL", "nan", "[0.01, 60]"),
        ("COLLSVC_HEARTBEAT_INTERVAL", "inf", "[0.01, 60]"),
        ("COLLSVC_HEARTBEAT_INTERVAL", "1e9", "[0.01, 60]"),
        ("COLLSVC_COORDINATOR_GRACE", "abc", "[0, 86400]"),
        ("COLLSVC_COORDINATOR_GRACE", "-1", "[0, 86400]"),
        ("COLLSVC_JOIN_TIMEOUT", "abc", "[0.001, 604800]"),
        ("COLLSVC_JOIN_TIMEOUT", "0", "[0.001, 604800]"),
        ("COLLSVC_PEER_PORT", "70000", "[0, 65535]"),
        ("COLLSVC_RING_SMALL_BYTES", "-5", ">= 0"),
        ("COLLSVC_SHM", "maybe", "1 or 0"),
        ("COLLSVC_ALLOW_UNAUTHENTICATED_PICKLE", "yes please", "1 or 0"),
    ],
)
def test_a_bad_value_names_the_variable_and_the_range(name: str, value: str, range_text: str) -> None:
    with pytest.raises(ValueError) as info:
        resolve({name: value})
    assert name in str(info.value) and range_text in str(info.value), str(info.value)


def test_good_values_are_taken() -> None:
    options = resolve(
        {
            "COLLSVC_HEARTBEAT_INTERVAL": "0.3",
            "COLLSVC_COORDINATOR_GRACE": "0",
            "COLLSVC_JOIN_TIMEOUT": "30",
            "COLLSVC_SHM": "false",
            "COLLSVC_ALLOW_UNAUTHENTICATED_PICKLE": "1",
        }
    )
    assert options.heartbeat_interval == 0.3 and options.coordinator_grace == 0.0
    assert options.join_timeout == 30.0 and options.shared_memory is False
    assert options.allow_pickle is True
    defaults = resolve({})
    assert defaults.heartbeat_interval == 1.0 and defaults.coordinator_grace == 20.0
    assert defaults.join_timeout is None and defaults.shared_memory is True


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "1e9"])
def test_the_elastic_reform_timeout_is_checked_too(value: str) -> None:
    with pytest.raises(ValueError) as info:
        elastic_reform_timeout({"COLLSVC_ELASTIC_TIMEOUT": value})
    assert "COLLSVC_ELASTIC_TIMEOUT" in str(info.value) and "[0.1, 86400]" in str(info.value)
    assert elastic_reform_timeout({}) == 10.0 and elastic_reform_timeout({"COLLSVC_ELASTIC_TIMEOUT": "2.5"}) == 2.5
