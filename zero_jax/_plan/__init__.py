"""``zj.plan``: will a model fit? The real step compiled for a mesh of the
target size, in a child process, and audited: on simulated CPU devices, or on
a TPU slice's devices with the TPU compiler, here, without a TPU
(``topology``: slices by name, their HBM, ``zj.topology_mesh``; ``plan``)."""
