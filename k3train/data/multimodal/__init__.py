"""Multimodal data: images and video clips interleaved with text, from Energon shards to ``Batch.media``.

Storage format (the source corpus): **Megatron-Energon WebDataset shards** -- tar files of ``<key>.json`` (the
sample's interleaved sequence) + ``<key>.<n>.png`` (its pictures), with the ``.nv-meta/`` files Energon reads
(:mod:`.shards`). Why: it is what Megatron users already keep multimodal corpora in (Megatron-LM's multimodal
examples and NeMo read it through Energon), it is plain tar (``tar tf`` / ``tarfile`` / ``webdataset`` read it;
no database, no custom container), it streams sequentially at any scale, and shards can be split between
preparation workers. We read it with Python's ``tarfile``: neither ``megatron-energon`` nor ``webdataset`` is a
dependency (we only need sequential reading at preparation time, not Energon's loader, blending or workers,
and adding its dependency tree to the trainer for ~100 lines of tar reading is not worth it).

What training reads (``tools/prepare_data.py --multimodal DIR --output-prefix PREFIX``, :mod:`.prepare`):

* ``PREFIX.bin/.idx``: a Megatron IndexedDataset of token ids, one document per shard sample, every media
  ALREADY expanded to ``[<|media_start|>] + merged_tokens(grid) x <|media_pad|> + [<|media_end|>]``
  (:func:`k3train.model.media.merged_tokens`: 448 x 448 px -> 256 tokens);
* ``PREFIX.media.bin/.media.npy``: the media store, resized uint8 pixels + an index of offsets, shapes, the
  document and position of each media (:mod:`.media_store`);
* ``PREFIX.meta.json``: tokenizer hash and the ``multimodal`` geometry checked at start-up (:mod:`.validate`).

Training rows (:mod:`.dataset`): whole documents packed into ``seq_len + 1``-token rows, media spans never cut,
deterministic from the seed and independent of the parallel layout; each micro-batch's :class:`Batch` carries
its media (``Batch.media``, ``Batch.media_rows``). The shipped corpus: :mod:`.shipped`; the vision tokenizer:
:mod:`.vl_tokenizer`.
"""
