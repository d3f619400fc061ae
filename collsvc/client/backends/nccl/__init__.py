"""The NCCL backend: CuPy arrays on GPUs, through NCCL (``cupy.cuda.nccl``).

``probe`` says whether it can run here; ``backend`` is the :class:`~collsvc.client.backends.base.Backend`;
``group_comm`` creates one NCCL communicator per group; ``blocks`` holds the grouped exchanges, copies
and folds the collectives are built from; ``dtypes`` maps dtypes and reduce ops; ``launcher`` enqueues
each operation in stream order and returns; ``watchdog`` watches what was enqueued and turns an
operation that outlives its deadline into an error instead of a spinning kernel; ``repeat`` is the GPU
side of the Communicator's fast path for repeated calls.
"""
