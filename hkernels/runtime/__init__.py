"""The runtime every backend stands on, at the bottom of the import order: its modules import nothing else of this
project (importing one runs ``hkernels/__init__.py`` first, as for any subpackage).

- ``interpret``: interpret mode (``HKERNELS_INTERPRET=1``: the kernels on CPU tensors in Triton's interpreter), fixed
  for the process when ``import hkernels`` first imports it.
- ``plan``: what the first call of a signature decided, replayed by every later call of it.
- ``launch``: the lean launch path of Triton kernels (the hand-written ones and Helion's generated ones), and
  ``torch.library.wrap_triton`` while a graph is traced.
- ``device``: what the host knows about the device (multiprocessors, arch), the user cache directory, the memos of
  launch settings.
- ``chunked``: the linear + cross-entropy chunk loop the backends share; ``routing``: a mixture of experts' routing
  on the device.

Above it: ``triton_fallback`` (the hand-written Triton kernels and their host functions), then the rest of
``hkernels`` (Helion kernels, configs, dispatch, the public functions), then ``bench``; ``tests/test_layers.py``
checks that imports point only down.
"""
