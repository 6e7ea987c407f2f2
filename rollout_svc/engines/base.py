"""The generation-engine interface every engine (hf, vllm, sim) implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0


@dataclass
class Completion:
    token_ids: np.ndarray  # int32 [T], includes the end-of-sequence token when one was sampled
    logprobs: np.ndarray  # float32 [T], log-prob of each token under the tempered behaviour policy
    versions: np.ndarray  # int32 [T], policy version that sampled each token
    finished: bool  # True if it ended with end-of-sequence, False if cut at max_new_tokens


class Engine(ABC):
    """Generates completions with per-token log-probs and takes new weights in place."""

    version: int  # policy version of the weights currently loaded

    @abstractmethod
    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[Completion]]:
        """`n` completions for each prompt (token ids); result[i][j] is prompt i's j-th."""

    @abstractmethod
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Replace the weights in place (no restart) and tag later tokens with `version`."""
