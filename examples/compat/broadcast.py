"""MindSpore's Broadcast example (seed 003), only its imports changed: every rank prints rank 0's [[0]], in a tuple.

Run: ``mpirun -np 4 python examples/compat/broadcast.py`` or ``collsvc run -n 4 examples/compat/broadcast.py``.
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
        self.broadcast = ops.Broadcast(0)

    def construct(self, x):
        return self.broadcast((x,))


input_x = Tensor(np.array([[0]]).astype(np.int32))
net = Net()
output = net(input_x)
print(output)
