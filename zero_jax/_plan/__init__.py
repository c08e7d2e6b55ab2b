"""``zj.plan``: will a model fit? The real step compiled for a mesh of the
target size, in a child process, and audited: on simulated CPU devices, or on
a TPU slice's or GPU hosts' devices with the TPU or GPU compiler, here, without
the hardware (``topology``: targets by name, their memory per device,
``zj.topology_mesh``; ``plan``), and
the ``keep_gathered`` / ``prefetch`` pair that fits a memory budget (``budget``:
``zj.choose_keep_gathered``)."""
