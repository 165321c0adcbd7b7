"""Data pipeline: real text -> byte-level BPE -> Megatron indexed dataset -> packed, layout-independent batches.

Public API (importing this package does not import megatron; the functions that need it import it lazily):

* :class:`Batch` -- ``[B, T]`` micro-batch with labels, masks, ``doc_ids``, ``positions`` and MTP targets.
* :class:`GlobalBatchLoader` -- this rank's micro-batches of each global batch; resumable.
* :func:`load_tokenizer` / :class:`TextTokenizer` -- the shipped 4096-id byte-level BPE.
* :func:`validate_indexed_dataset`, :func:`build_gpt_datasets`, :func:`write_indexed_dataset`.
* :func:`prepare` / :func:`train_tokenizer` -- what ``tools/prepare_data.py`` runs.
* :class:`DataError` -- every data problem (a ``ValueError`` with a one-line message naming the file).
* :mod:`k3train.data.multimodal` -- images / video interleaved with text (``data.format: multimodal``).
"""
from k3train.data.batch import Batch
from k3train.data.corpus import DEFAULT_CORPUS, DOC_SEPARATOR, DataError, read_documents
from k3train.data.dataset import build_gpt_datasets, validate_indexed_dataset, write_indexed_dataset
from k3train.data.loader import GlobalBatchLoader
from k3train.data.prepare import prepare, train_tokenizer
from k3train.data.tokenizer import DEFAULT_TOKENIZER, TextTokenizer, load_tokenizer

__all__ = [
    "Batch", "DataError", "DEFAULT_CORPUS", "DEFAULT_TOKENIZER", "DOC_SEPARATOR", "GlobalBatchLoader",
    "TextTokenizer", "build_gpt_datasets", "load_tokenizer", "prepare", "read_documents", "train_tokenizer",
    "validate_indexed_dataset", "write_indexed_dataset",
]
