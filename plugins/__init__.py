"""Framework adapters for tpde: the plain-PyTorch optimizer hook (and, later, Lightning)."""
