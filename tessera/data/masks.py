"""Loss masks in the token streams. A token that is not trained as a target (a prompt, a user turn, a template's
header) travels through the packing loader as its id's bitwise complement (~id, negative); the window's labels
are IGNORE where their token is one, the inputs the ids themselves. Text data has none: its windows are as before."""

import numpy as np
import torch

IGNORE = -100  # the label of a position that is not trained (torch's and transformers' ignore_index)


def untrained(ids: np.ndarray) -> np.ndarray:
    """`ids` (int32) marked as not trained."""
    return ~ids


def split_windows(windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows [batch, seq_len + 1] (untrained tokens complemented) -> (inputs, labels), LongTensor [batch,
    seq_len]: label j is token j + 1, IGNORE where that token is not trained."""
    windows = windows.astype(np.int64)
    marked = windows < 0
    if not marked.any():
        windows = torch.from_numpy(windows)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    ids = np.where(marked, ~windows, windows)
    labels = np.where(marked[:, 1:], IGNORE, ids[:, 1:])
    return torch.from_numpy(np.ascontiguousarray(ids[:, :-1])), torch.from_numpy(labels)


def trained_tokens(labels: torch.Tensor) -> torch.Tensor:
    """The number of trained targets among `labels`."""
    return (labels != IGNORE).sum()
