"""Layer-wise ZeRO-2/3: parameters whole only while their layer runs.

Read in this order: ``scope`` (the trace-time scope: which policy the loss is
traced under), ``pieces`` (the :class:`Sharded` pieces a manual step hands its
loss, ``zj.gather``, ``zj.embedding_lookup``, and the check that nothing else reads them), ``schedule``
(the one seam for compiler scheduling tricks, per backend), ``activations``
(ZeRO-R's P_a for the saved layer inputs), ``keep`` (``keep_gathered``: which
trailing blocks keep their gathered parameters for the backward pass), then the two primitives: ``scan``
(``zj.scan_layers`` over stacked layers) and ``blocks`` (``zj.apply_layer(s)``
over a Python loop of blocks); last ``head`` (``zj.head_cross_entropy``: a
language model's head and loss a vocabulary chunk at a time)."""
