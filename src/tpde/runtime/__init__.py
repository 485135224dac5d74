"""What the process provides the layers above: its frame threads, its decode buffers and
heap, and which C extensions it has.

May import: ``tpde.errors``.
"""
