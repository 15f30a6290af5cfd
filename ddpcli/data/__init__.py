"""Data, one module per job:

- `sets`: the data sets (synthetic, STL-10, image folders), loaded or listed, and checked;
- `augment`: random-resized and padded crops, flips: a pure function of (seed, epoch, index);
- `device`: device-resident batches (`--data-path device`);
- `loader`: DataLoader batches (`--data-path loader`);
- `pipeline`: sharding and the batches the training loop sees.
"""
