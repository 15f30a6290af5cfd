"""Lightning's Trainer with the DDP strategy on the CPU (Gloo).

    python benchmarks/peers/lightning_trainer.py --devices 2 --steps 60

Lightning starts the other rank itself (its subprocess launcher re-runs this script) and
puts a DistributedSampler under the DataLoader. A callback times the steps. Logging,
checkpointing, the progress bar, the model summary and validation are off, as they would
be in a throughput run; the step logs loss and accuracy with `self.log`, as a module does.
"""

from __future__ import annotations

import lightning as L
import torch
import torchvision
from _common import (
    AugmentCollate,
    Throughput,
    apply_thread_count,
    in_memory_images,
    parse_args,
    write_result,
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Classifier(L.LightningModule):
    def __init__(self, arch: str, lr: float):
        super().__init__()
        self.model = torchvision.models.get_model(arch, weights=None, num_classes=10)
        self.criterion = nn.CrossEntropyLoss()
        self.lr = lr

    def training_step(self, batch, batch_idx):
        images, target = batch
        output = self.model(images)
        loss = self.criterion(output, target)
        self.log("train_loss", loss)
        self.log("train_acc", (output.argmax(1) == target).float().mean())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), self.lr, momentum=0.9, weight_decay=5e-4)


class ThroughputCallback(L.Callback):
    def __init__(self, args):
        self.args = args
        self.meter = Throughput(args.warmup)
        self.threads = 0

    def on_train_start(self, trainer, pl_module):
        self.threads = torch.get_num_threads()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.meter.step(len(batch[1]))

    def on_train_end(self, trainer, pl_module):
        rate = self.meter.images_per_sec()
        if trainer.global_rank == 0:
            print(f"lightning: {rate:.1f} img/s")
        write_result(self.args.result, "lightning", rate, self.args.steps, self.threads)


def main() -> None:
    args = parse_args(__doc__)
    apply_thread_count()
    L.seed_everything(args.seed, verbose=False)
    dataset = TensorDataset(*in_memory_images(args.devices, args))
    # Lightning swaps the shuffling sampler for a DistributedSampler (use_distributed_sampler).
    loader = DataLoader(
        dataset,
        batch_size=args.batch,
        shuffle=True,
        num_workers=0,
        collate_fn=AugmentCollate(args.seed),
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp",
        max_epochs=1,
        max_steps=args.total_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[ThroughputCallback(args)],
        # Lightning's own default ("32-true") unless bf16 is asked for: its bf16 autocast.
        **({"precision": "bf16-mixed"} if args.precision == "bf16" else {}),
    )
    trainer.fit(Classifier(args.arch, args.lr), train_dataloaders=loader)
    if torch.distributed.is_initialized():
        # Lightning leaves the group up; a Gloo rank can then abort at interpreter exit.
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
