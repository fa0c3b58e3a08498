"""Train a tiny MeshTrainer that checkpoints every 2 steps and is SIGKILLed in the middle of writing
checkpoint-4 (after the model, before the optimizer): what a crash during a save leaves behind.

    python tests/scripts/killed_save.py OUTPUT_DIR
"""

from __future__ import annotations

import os
import signal
import sys

from hf_meshtune import MeshTrainer, MeshTrainingArguments
from tests.tiny import pattern_dataset, tiny_llama


class KilledMidSave(MeshTrainer):
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.state.global_step == 4:
            os.kill(os.getpid(), signal.SIGKILL)
        super()._save_optimizer_and_scheduler(output_dir)


def main(output_dir: str) -> None:
    args = MeshTrainingArguments(
        output_dir,
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        seed=0,
        report_to=[],
        use_cpu=True,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        lr_scheduler_type="constant",
        preset="paper",
        num_stages=2,
        mask_ratio=0.5,
        anchor_every=2,
        anchor_delay=1,
    )
    KilledMidSave(model=tiny_llama(), args=args, train_dataset=pattern_dataset()).train()


if __name__ == "__main__":
    main(sys.argv[1])
