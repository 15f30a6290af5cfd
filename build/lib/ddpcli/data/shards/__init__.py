"""Shards: a data set packed into WebDataset-format tar files (`ddpcli data pack`) and
checked against their index (`ddpcli data verify`), one module per job:

- `sources`: what is packed (an image folder or STL-10), each sample's key, the seeded order
  and the plan of shards; `stl10`: STL-10's binary layout read without torch, as PNGs;
- `writer`: one shard, deterministic and atomic; `parallel`: shards over worker processes;
- `index`: the versioned `index.json`; `pack` and `verify`: the two commands' engines;
- `storage`: where shards are read from (a folder, a URL);
- training from shards (`--dataset shards`): `plan`, an epoch's shard order, streams and
  the pieces left, pure arithmetic; `stream`, a stream's samples as raw bytes through its
  shuffle buffer; `checks`, what is checked before a step; `feed`, a rank's batches (torch).

Imports no torch but in `feed` (packing needs files, not a model): numpy and PIL only where
pixels are encoded. Part of data/: may import config/ and the shared top-level modules only.
"""
