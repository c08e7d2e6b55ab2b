"""Where each leaf is cut: the partition rule of one leaf (``leaf``:
:class:`LeafLayout`, ``leaf_layout``, padding, ``is_float``) and trees of
layouts (``trees``). The one home of layouts: a parameter, its gradient and
every optimizer-state leaf that mirrors it share one layout."""
