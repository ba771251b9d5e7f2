"""A generated image set: four shape classes at random places and sizes, with noise (fixed seed)."""

from __future__ import annotations

import torch

CLASSES = ("disc", "square", "cross", "ring")
SIZE = 24


def make_images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ys, xs = torch.meshgrid(torch.arange(SIZE), torch.arange(SIZE), indexing="ij")
    labels = torch.randint(len(CLASSES), (n,), generator=g)
    images = torch.zeros(n, 1, SIZE, SIZE)
    for i in range(n):
        r = 3 + float(torch.rand(1, generator=g)) * 5
        cy, cx = (r + torch.rand(2, generator=g) * (SIZE - 2 * r)).tolist()
        dy, dx = ys - cy, xs - cx
        dist = (dy**2 + dx**2).sqrt()
        kind = CLASSES[int(labels[i])]
        if kind == "disc":
            mask = dist <= r
        elif kind == "square":
            mask = (dy.abs() <= r * 0.8) & (dx.abs() <= r * 0.8)
        elif kind == "cross":
            mask = ((dy.abs() <= 1) & (dx.abs() <= r)) | ((dx.abs() <= 1) & (dy.abs() <= r))
        else:
            mask = (dist <= r) & (dist >= r - 1.5)
        images[i, 0] = mask.float()
    images += 0.3 * torch.randn(images.shape, generator=g)
    return images, labels
