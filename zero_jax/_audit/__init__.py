"""Reading a compiled step: what it holds (``memory``, allocation beside XLA's
live peak: fragmentation), what it sends
(``hlo``: collectives after SPMD partitioning, loops and trip counts), the
compiled program as the backend runs it (``compiled``: each collective however
the backend spells it, TPU's async and decomposed forms included), its
schedule (``schedule``: per-layer gathers and reductions, layers alive,
overlap with compute), its communication buffers (``buffers``: collectives
per block, the largest buffer), the communication theory per leaf
(``communication``, int8 wires included), the model-axis view
(``model_axes``), the contract's violations (``violations``), the report
(``report``) and ``zj.audit`` itself (``audit``)."""
