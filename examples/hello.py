"""The smallest collsvc job: join, print who we are, pass a barrier.

Run:  collsvc run -n 4 examples/hello.py
"""

import collsvc

comm = collsvc.init()
print(
    f"rank={comm.rank} size={comm.size} local_rank={comm.local_rank} node_rank={comm.node_rank} backend={comm.backend}",
    flush=True,
)
comm.barrier()
collsvc.destroy()
