"""MindSpore's AllGather example (seed 003), only its imports changed:
every rank prints [[0.] [1.] [2.] [3.]] at 4 ranks.

Run: ``mpirun -np 4 python examples/compat/allgather.py`` or ``collsvc run -n 4 examples/compat/allgather.py``.
"""

import numpy as np

import collsvc.compat.mindspore.nn as nn
import collsvc.compat.mindspore.ops as ops
from collsvc.compat.mindspore import Tensor, context
from collsvc.compat.mindspore.communication import get_rank, init

context.set_context(mode=context.GRAPH_MODE)
init()


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.allgather = ops.AllGather()

    def construct(self, x):
        return self.allgather(x)


value = get_rank()
input_x = Tensor(np.array([[value]]).astype(np.float32))
net = Net()
output = net(input_x)
print(output)
