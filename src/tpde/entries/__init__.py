"""Checkpoint entries, the small files at checkpoint paths that name a chain's steps
(``entry``), and a folder of them as one whole (``checkpoint_folder``)."""
