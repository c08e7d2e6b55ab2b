"""ZeRO's arithmetic, pure: what a stage holds and sends per device
(``formulas``), which stage to pick (``choice``), how many bytes a quantized
piece puts on the wire (``wire``), and the checks of the formulas' arguments
(``checks``). With the policy, the only place that compares stage numbers."""
