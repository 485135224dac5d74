"""``tpde.mount``: a model whose stored weights are decoded just in time (``model``), and
which stored records each of its modules needs (``slots``)."""
