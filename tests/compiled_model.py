"""A small model for the torch.compile tests (tests/integration/test_compiled.py): the
"model's own file" whose lines compiled code must be attributed to. Each
line that makes an FX node ends with a marker the tests look up."""

import torch


class Block(torch.nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        h = self.up(x)  # UP
        h = torch.relu(h) * 2  # ACT
        return self.down(h)  # DOWN


class Model(torch.nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.block = Block(width)

    def forward(self, x):
        y = self.block(x)  # BLOCK
        return (y * y).sum()  # LOSS
