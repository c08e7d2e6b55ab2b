"""The vocabulary every other concept speaks: key paths as users write them
(``tree``), numbers with units and the one byte formatter (``units``), the one
data-dependence walk over a traced program (``jaxpr``), and one error for
every problem a check finds (``problems``)."""
