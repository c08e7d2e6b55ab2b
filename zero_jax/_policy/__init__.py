"""The policy: ``ZeroPolicy`` (``policy``) and the values it is made of: its
argument checks (``arguments``), mixed precision and the loss scale
(``precision``), memory kinds and offload options (``memory``), the batch
layout (``batch``), the model's own ``param_specs`` (``model_specs``), and
placing trees of leaves per the policy (``placement``)."""
