"""Several processes: fresh child processes with their own simulated devices
(``child``, for ``zj.plan``), P local processes as one pod (``launch``), and
what a multi-controller run needs (``multihost``: process-local batches, the
start-up agreement check)."""
