"""Offline data preparation for megabeta (the ``megabeta-data`` command).

Modules: ``corpus`` (inputs to documents), ``train_tokenizer``, ``tokenizer`` (loading a model),
``encode`` (documents to tokens, worker processes), ``tokenize_corpus`` (the tokenize command, MPI
ranks), ``writer`` (streaming MMIDIDX writer), ``merge``, ``inspect_dataset``, ``atomic``
(temporary names, rename on success), ``progress``, ``mpi``, ``cli``. The on-disk format is
defined once, in :mod:`megabeta.data.format`, and shared with the readers in ``megabeta.data``.
"""
