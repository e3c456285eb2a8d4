"""whiteformer.app.train.loop.finetune: the loop ends at max_steps, whatever the number of epochs."""
import torch
import torch.nn as nn

from whiteformer.app.train.loop import finetune


class _Regression:
    """A task of one batch per epoch (x -> 2x); counts the epochs the loop visits."""

    def __init__(self):
        self.epochs_visited = 0

    @property
    def steps_per_epoch(self):
        self.epochs_visited += 1
        if self.epochs_visited > 1000:
            raise RuntimeError("the loop went on past max_steps")
        return 1

    def train_batch(self, step):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        return x, 2 * x

    def loss(self, model, x, y):
        return ((model(x) - y) ** 2).mean(), {"count": torch.tensor(len(x))}


def test_finetune_ends_at_max_steps_with_a_huge_number_of_epochs():
    """``compress --finetune-epochs 99999999999999999999 --max-steps 1`` never ended: the epoch loop
    went on after max_steps stopped the step loop."""
    task = _Regression()
    res = finetune(nn.Linear(4, 4), task, epochs=99999999999999999999, max_steps=1, lr=1e-2)
    assert res["steps"] == 1 and task.epochs_visited <= 3
