"""The communicator: the local one is the identity; timeouts are checked before a group is used."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from embcore.base.comm import DEFAULT_TIMEOUT, LocalCommunicator, _as_timeout, make_communicator


def test_local_communicator_is_the_identity():
    comm = make_communicator(None)
    assert isinstance(comm, LocalCommunicator) and (comm.rank, comm.world_size) == (0, 1)
    x = torch.arange(6.0).view(3, 2)
    assert comm.all_to_all([x])[0] is x
    assert comm.all_reduce_sum(x) is x and comm.all_gather(x)[0] is x


def test_timeouts():
    assert _as_timeout(None) == DEFAULT_TIMEOUT
    assert _as_timeout(3) == timedelta(seconds=3)
    assert _as_timeout(timedelta(minutes=1)) == timedelta(minutes=1)
    for bad in ("60", True, [1]):
        with pytest.raises(TypeError, match="timeout must be a number of seconds"):
            make_communicator(None, bad)
    for bad in (0, -1.0, float("inf"), timedelta(0)):
        with pytest.raises(ValueError, match="timeout must be a finite number of seconds > 0"):
            make_communicator(None, bad)
