"""The train step: the sharded optax transformation (``optimizer``), offload
of optimizer state and parameters to host memory (``offload``), the
``TrainState`` (``state``), the gradient program (``grads``), the optimizer
update (``update``), and ``make_train_step`` which composes them (``train``)."""
