"""MindSpore's AllReduce example (seed 003), only its imports changed: every rank prints [[6.]] at 4 ranks.

Run: ``mpirun -np 4 python examples/compat/allreduce.py`` or ``collsvc run -n 4 examples/compat/allreduce.py``.
"""

import numpy as np

import collsvc.compat.mindspore.nn as nn
import collsvc.compat.mindspore.ops as ops
from collsvc.compat.mindspore import Tensor
from collsvc.compat.mindspore.communication import get_rank, init

init()


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.allreduce_sum = ops.AllReduce(ops.ReduceOp.SUM, group="nccl_world_group")

    def construct(self, x):
        return self.allreduce_sum(x)


value = get_rank()
input_x = Tensor(np.array([[value]]).astype(np.float32))
net = Net()
output = net(input_x)
print(output)
