"""MindSpore's ReduceScatter example (seed 003), only its imports changed:
rank r prints [[4r]] at 4 ranks ([[0.]] on rank 0).

Run: ``mpirun -np 4 python examples/compat/reducescatter.py`` or ``collsvc run -n 4 examples/compat/reducescatter.py``.
"""

import numpy as np

import collsvc.compat.mindspore.nn as nn
import collsvc.compat.mindspore.ops as ops
from collsvc.compat.mindspore import Tensor, context
from collsvc.compat.mindspore.communication import init

context.set_context(mode=context.GRAPH_MODE)
init()


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.reducescatter = ops.ReduceScatter(ops.ReduceOp.SUM)

    def construct(self, x):
        return self.reducescatter(x)


input_x = Tensor(np.array([[0], [1], [2], [3]]).astype(np.float32))
net = Net()
output = net(input_x)
print(output)
