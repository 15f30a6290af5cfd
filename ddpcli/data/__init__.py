"""Data, one module per job:

- `sets`: the data sets (synthetic, STL-10, image folders), loaded or listed, and checked;
  `layout`: what the launcher checks about them without torch; `custom`: a user's own sets;
- `augment`: random-resized and padded crops, flips: a pure function of (seed, epoch, index);
  `autoaugment`, `erasing`, `mixing`: the recipe's torchvision v2 transforms, pure draws;
- `device`: device-resident batches (`--data-path device`); `loader`: DataLoader batches
  (`--data-path loader`), `decode`: image files to pixels; `encoded`: `--decode gpu`, the
  workers' bytes decoded and viewed on the rank's device; `ra_sampler`: --ra-reps;
- `pipeline`: sharding and the batches the training loop sees; `resharding`: where an epoch
  stands, continued by any world.
- `shards/`: `ddpcli data pack|verify`, a data set as WebDataset-format tar shards and their
  index (no torch), and `--dataset shards`: the epoch planned from the index, streamed.

May import config/ and the shared top-level modules only.
tests/test_architecture.py holds the table.
"""
