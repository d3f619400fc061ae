"""collsvc.elastic.State on its own: commit points, restore in place, and the broadcast on a real job."""

from __future__ import annotations

import numpy as np
import pytest

import collsvc
from collsvc.elastic.state import State
from tests.harness import coordinator, run_ranks


def test_restore_goes_back_to_the_last_commit_in_place() -> None:
    weights = np.zeros(3)
    state = State(step=0, w=weights, history=[], optimizer={"lr": 0.1, "momentum": np.ones(2)})
    state.step = 5
    state.w += 1.0
    state.history.append("a")
    state.commit()
    state.step = 9
    state.w += 10.0
    state.history.append("b")
    state.optimizer["momentum"] *= 3.0
    state.optimizer["lr"] = 0.5
    state.restore()
    assert state.step == 5 and state.history == ["a"]
    assert state.w is weights and weights.tolist() == [1.0, 1.0, 1.0]  # references held elsewhere stay valid
    assert state.optimizer["lr"] == 0.1 and state.optimizer["momentum"].tolist() == [1.0, 1.0]


def test_a_value_replaced_by_another_shape_is_restored_as_a_copy() -> None:
    state = State(w=np.arange(3.0))
    state.w = np.zeros((2, 2))
    state.restore()
    assert state.w.tolist() == [0.0, 1.0, 2.0]
    state.w[0] = 7.0
    state.restore()
    assert state.w[0] == 0.0  # the restore point itself was not handed out


def test_names_behave_like_attributes() -> None:
    state = State(step=1)
    state.extra = "x"
    assert state.as_dict() == {"step": 1, "extra": "x"}
    del state.extra
    with pytest.raises(AttributeError, match="no value 'extra'"):
        _ = state.extra
    with pytest.raises(AttributeError, match="must not start with '_'"):
        state._hidden = 1


def test_torch_tensors_and_state_dicts_restore_in_place() -> None:
    torch = pytest.importorskip("torch")
    module = torch.nn.Linear(2, 2)
    parameter = torch.zeros(3, requires_grad=True)
    state = State(p=parameter, model=module.state_dict())
    with torch.no_grad():
        parameter += 2.0
        state.model["bias"] += 1.0
    state.restore()
    assert state.p is parameter and parameter.tolist() == [0.0, 0.0, 0.0]
    assert torch.equal(state.model["bias"], module.state_dict()["bias"])


def _broadcast_from_rank_1(comm: collsvc.Communicator) -> dict[str, object]:
    mine = np.full(4, float(comm.rank))
    state = State(step=comm.rank, w=mine, nested={"m": np.full((2, 2), comm.rank, dtype=np.int32)}, note=None)
    if comm.rank == 1:
        state.note = "from one"
        state.grown = np.ones(5)  # a value the others do not have yet
    state.broadcast(comm, src=1)
    state.w += 0.5
    state.restore()  # the broadcast state is the restore point
    return {
        "step": state.step,
        "w": state.w.tolist(),
        "same_array": state.w is mine,
        "m": state.nested["m"].tolist(),
        "note": state.note,
        "grown": state.grown.tolist(),
    }


def test_broadcast_replaces_every_rank_s_values_with_the_source_s() -> None:
    with coordinator() as (_, address):
        result = run_ranks(_broadcast_from_rank_1, world_size=3, address=address)
    for value in result.values:
        assert value["step"] == 1 and value["w"] == [1.0] * 4 and value["note"] == "from one"
        assert value["m"] == [[1, 1], [1, 1]] and value["grown"] == [1.0] * 5
        assert value["same_array"]  # received in place
