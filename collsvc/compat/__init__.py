"""Drop-in faces of the APIs collsvc was designed from, so their users keep their scripts.

- :mod:`collsvc.compat.nnabla`: nnabla's ``communicators`` and ``ext_utils``, with numpy-backed
  ``NdArray`` and ``Variable`` for scripts without nnabla.
- :mod:`collsvc.compat.bagua`: Bagua's ``bagua.torch_api.communication`` and ``with_bagua`` (imports torch).
- :mod:`collsvc.compat.mindspore`: the module paths of MindSpore's collective primitives, numpy-backed.

Each face only translates names and argument conventions onto :class:`collsvc.Communicator`: no face
has its own data plane, errors or retries; errors are collsvc's (``docs/compat.md``). Importing this
package imports none of them.
"""
