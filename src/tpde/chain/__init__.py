"""The chain: which steps exist, what a new step stores against which reference, how a step is
rebuilt, and what a run may delete.

Layout of a run folder::

    tpde.json                      marks the folder as a tpde run
    data/<step>-<uuid>.tpd         one blob per step: the compressed sections of its records
    steps/<step>.json              the manifest; its appearance commits the step
    removed/<step>                 a tombstone: the step is hidden, its data kept while needed

A step is written blob first, manifest last, so a crash leaves at most an unreferenced blob
(deleted by ``gc``) and never a visible half step. The jobs live in their own modules:
``plan`` decides (pure functions of manifests), ``read``, ``write`` and ``retain`` carry the
decisions out (``save`` codes a step's pieces, ``ranks`` a rank's share of a sharded step), and
``spans`` puts a rebuilt step's tensors together. ``Chain`` (``chain.chain``), what front ends
hold, composes a run (``base.Run``: listings and manifests) with its ``Reader``, ``Writer`` and
``Retainer``. Front ends and plugins use the names in ``__all__`` alone (``tests/test_layers.py``
checks it).

May import: ``tpde.errors``, ``tpde.runtime``, ``tpde.codec``, ``tpde.kernels``,
``tpde.state``, ``tpde.manifest``, ``tpde.store``.
"""

from tpde.chain import native, sharded
from tpde.chain.base import DATA, MARKER, REMOVED, STEPS, GcReport, Problem, Reads, Reference
from tpde.chain.chain import Chain
from tpde.chain.options import SaveOptions, whole
from tpde.chain.plan import (DEFAULT_KEYFRAME_EVERY, DELTAS_AGAINST, KEYFRAME, PREVIOUS, AtRest,
                             batches)
from tpde.chain.ranks import Held, RankPiece, RankSave, Share, commit_shards
from tpde.chain.read import DECODE_BATCH_BYTES
from tpde.chain.spans import lossy_summary, span_places, span_words
from tpde.chain.write import PIECE_BYTES


__all__ = ["AtRest", "Chain", "DATA", "DECODE_BATCH_BYTES", "DEFAULT_KEYFRAME_EVERY",
           "DELTAS_AGAINST", "GcReport", "Held", "KEYFRAME", "MARKER", "PIECE_BYTES", "PREVIOUS",
           "Problem", "RankPiece", "RankSave", "Reads", "REMOVED", "Reference", "STEPS",
           "SaveOptions", "Share", "batches", "commit_shards", "lossy_summary", "native",
           "sharded", "span_places", "span_words", "whole"]
