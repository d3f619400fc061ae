"""The NCCL backend against the real CuPy and NCCL library, on any machine where they install.

Needs CuPy and the NCCL library (``pip install 'collsvc[cuda12]' nvidia-nccl-cu12``), not a GPU: these are
the parts of the contract that hold without a device (names, signatures, enum values, the unique id and
the form ``NcclCommunicator`` takes it in), and what a process without a GPU reports. Skipped when CuPy
or its NCCL library is missing, as on CPU CI; the fake that CI uses is pinned to the same tables in
``test_nccl_fake.py``.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from collsvc.client.backends.nccl.group_comm import UID_BYTES, new_communicator, unique_id
from collsvc.client.backends.nccl.probe import REQUIRED_COMMUNICATOR_METHODS, REQUIRED_NCCL_NAMES, load_cupy
from collsvc.client.devices import cupy_available, local_device
from collsvc.errors import BackendUnavailableError
from tests.gpu.cupy_contract import COMMUNICATOR_METHODS, MEMCPY_DEVICE_TO_DEVICE, NCCL_CONSTANTS, parameters


def _nccl() -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from cupy.cuda import nccl
    except Exception:
        return None
    return nccl if getattr(nccl, "available", False) else None


nccl = _nccl()
pytestmark = pytest.mark.skipif(nccl is None, reason="needs CuPy and its NCCL library (no GPU needed)")


def test_every_name_the_backend_calls_exists() -> None:
    assert [n for n in REQUIRED_NCCL_NAMES if not hasattr(nccl, n)] == []
    assert [n for n in REQUIRED_COMMUNICATOR_METHODS if not hasattr(nccl.NcclCommunicator, n)] == []


def test_communicator_signatures_match_the_contract() -> None:
    for name, expected in COMMUNICATOR_METHODS.items():
        assert parameters(getattr(nccl.NcclCommunicator, name)) == expected, name


def test_enum_values_match_nccl_h() -> None:
    import cupy

    assert {n: int(getattr(nccl, n)) for n in NCCL_CONSTANTS} == NCCL_CONSTANTS
    assert int(cupy.cuda.runtime.memcpyDeviceToDevice) == MEMCPY_DEVICE_TO_DEVICE


def test_unique_id_round_trips_into_the_communicator() -> None:
    """ncclGetUniqueId needs no GPU; the id must reach ncclCommInitRank, not fail in argument conversion."""
    data = unique_id(nccl)
    assert isinstance(data, bytes) and len(data) == UID_BYTES
    assert unique_id(nccl) != data  # a fresh id each time
    if cupy_available():  # a GPU: world size 1 initialises for real
        comm = new_communicator(nccl, 1, data, 0)
        assert (comm.size(), comm.rank_id()) == (1, 0)
        comm.destroy()
        return
    with pytest.raises(nccl.NcclError):  # no GPU: NCCL itself refuses, after taking the id
        new_communicator(nccl, 1, data, 0)


@pytest.mark.skipif(cupy_available(), reason="checks what a process without a GPU reports")
def test_without_a_gpu_the_process_reports_cpu_and_nccl_is_unavailable() -> None:
    assert local_device(0).kind == "cpu"
    with pytest.raises(BackendUnavailableError, match="needs a CUDA GPU"):
        load_cupy()
