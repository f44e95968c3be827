"""Dynamic masking, drawn afresh for every batch on the device (RoBERTa / DistilBERT style).

Each sequence gets exactly its share of masked tokens: of its ``n`` eligible tokens (everything
but special and padding tokens), ``floor(p n + u)`` with ``u ~ U(0, 1)`` are chosen, an
unbiased rounding of ``p n``. They are chosen without replacement by the Gumbel-top-k trick:
each candidate gets the key ``log w - log E`` with ``E ~ Exp(1)`` and the highest keys win,
which is exactly sequential sampling with probability proportional to ``w``. ``w = 1`` gives a
uniform choice; frequency smoothing (DistilBERT) uses ``w = count^-alpha`` from the dataset's
``token_counts.npy``, so rare tokens are chosen more often than their frequency.

With whole-word masking the candidates are words (a WordPiece ``##`` piece belongs to the word
before it; for byte-level BPE a piece without the ``Ġ`` space marker does), weighted by their
rarest piece, and words are taken in key order while they fit in the sequence's token budget.

Of the chosen tokens, 80% become [MASK], 10% a random non-special token and 10% stay as they
are.

The masker is the one owner of the masking budget: no sequence of ``seq`` tokens ever has more
than ``max_masked(p, seq) = ceil(p seq)`` tokens chosen (``floor(p n + u) <= ceil(p seq)`` since
``n <= seq`` and ``u < 1``; whole words are taken only while they fit). It hands the step those
positions as a fixed ``[batch, budget]`` index with a validity mask (:class:`Positions`), so the
losses gather exactly the predicted tokens without boolean indexing, which would need the count
on the host. Everything is tensor arithmetic of fixed shape (no ``nonzero``, no ``.item()``), so masking
never waits for the device; the randomness comes only from the ``torch.Generator`` passed in,
which the training loop seeds from (seed, step, rank) with :func:`seeded_generator`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from common.config import ConfigError
from trainer.config import MaskingConfig

IGNORE_INDEX = -100  # label of the tokens not chosen (PyTorch's cross-entropy default)


def max_masked(probability: float, seq_len: int) -> int:
    """The most tokens one sequence of ``seq_len`` can have chosen: the fixed budget of predicted positions."""
    return max(1, math.ceil(probability * seq_len))


@dataclasses.dataclass
class Positions:
    """Where a loss applies: ``index`` ``[batch, P]`` into the sequence (None: every position), and which are real."""

    index: torch.Tensor | None
    valid: torch.Tensor

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """``x[b, index[b, p]]``: ``[batch, seq, ...]`` -> ``[batch, P, ...]``."""
        if self.index is None:
            return x
        rows = torch.arange(x.shape[0], device=x.device)[:, None]
        return x[rows, self.index]

    def to(self, device: torch.device) -> Positions:
        return Positions(None if self.index is None else self.index.to(device), self.valid.to(device))


@dataclasses.dataclass
class MaskedBatch:
    """One masked batch: what the model reads, and what it must predict where.

    ``input_ids`` ``[batch, seq]``: the corrupted ids. ``labels`` ``[batch, seq]``: the original
    id where chosen, ``IGNORE_INDEX`` elsewhere (the usual dense form). ``positions``: the chosen
    positions as a ``[batch, budget]`` index (unused slots not valid), and ``targets`` ``[batch,
    budget]``: the original ids there, which the masked-LM loss compares with.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    positions: Positions
    targets: torch.Tensor

    @classmethod
    def from_labels(cls, input_ids: torch.Tensor, labels: torch.Tensor, budget: int) -> MaskedBatch:
        """Locate the labelled positions in a fixed ``[batch, budget]`` index (at most ``budget`` per row)."""
        chosen = labels != IGNORE_INDEX
        index = chosen.float().topk(budget, dim=1, sorted=False).indices
        positions = Positions(index=index, valid=chosen.gather(1, index))
        return cls(input_ids, labels, positions, positions.take(labels))

    def to(self, device: torch.device) -> MaskedBatch:
        """The same batch on ``device``."""
        moved = (self.input_ids.to(device), self.labels.to(device), self.positions.to(device), self.targets.to(device))
        return MaskedBatch(*moved)


def seeded_generator(*entropy: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from several integers, e.g. ``(seed, step, rank)``: independent streams per tuple."""
    state = np.random.SeedSequence([int(e) for e in entropy]).generate_state(2, np.uint32)
    generator = torch.Generator(device=device)
    generator.manual_seed((int(state[0]) << 31) ^ int(state[1]))
    return generator


def word_continuations(tokenizer: Any) -> torch.Tensor:
    """``[vocab]`` bool: True for pieces that continue the previous token's word."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    if spec["model"]["type"] == "WordPiece":
        prefix = spec["model"].get("continuing_subword_prefix") or "##"
        return torch.tensor([piece.startswith(prefix) for piece in pieces])
    pre_tokenizer = json.dumps(spec.get("pre_tokenizer"))
    marker = "Ġ" if "ByteLevel" in pre_tokenizer else "▁" if "Metaspace" in pre_tokenizer else None
    if marker is None:
        raise ConfigError(
            "masking.whole_word: cannot tell word boundaries for this tokenizer "
            "(supported: WordPiece '##', byte-level BPE 'Ġ', SentencePiece '▁')"
        )
    return torch.tensor([not piece.startswith(marker) for piece in pieces])


class DynamicMasker:
    """Chooses and corrupts the tokens to predict; built once, then called on every batch on the device."""

    def __init__(
        self,
        cfg: MaskingConfig,
        *,
        vocab_size: int,
        mask_id: int,
        special_ids: list[int],
        token_counts: np.ndarray | None = None,
        continuations: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.cfg = cfg
        self.mask_id = mask_id
        special = torch.zeros(vocab_size, dtype=torch.bool)
        special[list(special_ids)] = True
        self.special = special.to(device)
        self.replacements = torch.arange(vocab_size)[~special].to(device)  # random replacements: no specials
        self.log_weight = None
        if cfg.frequency_smoothing is not None:
            if token_counts is None or len(token_counts) != vocab_size:
                found = "none" if token_counts is None else f"{len(token_counts)} entries"
                raise ConfigError(
                    f"masking.frequency_smoothing: needs counts for the {vocab_size}-token vocabulary, got {found}"
                )
            counts = torch.as_tensor(np.asarray(token_counts, dtype=np.float64)).clamp_min(1.0)
            self.log_weight = (-cfg.frequency_smoothing * counts.log()).float().to(device)
        self.continuations = None
        if cfg.whole_word:
            if continuations is None:
                raise ConfigError("masking.whole_word: needs the tokenizer's word-continuation table")
            self.continuations = continuations.to(device)

    @classmethod
    def from_tokenizer(
        cls,
        cfg: MaskingConfig,
        tokenizer: Any,
        token_counts: np.ndarray | None = None,
        device: torch.device | str = "cpu",
    ) -> DynamicMasker:
        return cls(
            cfg,
            vocab_size=len(tokenizer),
            mask_id=tokenizer.mask_token_id,
            special_ids=tokenizer.all_special_ids,
            token_counts=token_counts,
            continuations=word_continuations(tokenizer) if cfg.whole_word else None,
            device=device,
        )

    def __call__(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, generator: torch.Generator
    ) -> MaskedBatch:
        """Choose, corrupt and locate the tokens to predict (see :class:`MaskedBatch`).

        ``attention_mask`` may be None (a packed batch without padding); padding is never chosen
        either way, since the pad token is special.
        """
        ids = input_ids.long()
        chosen = self.choose(ids, attention_mask, generator)
        action = torch.rand(ids.shape, device=ids.device, generator=generator)
        draw = torch.randint(len(self.replacements), ids.shape, device=ids.device, generator=generator)
        to_mask = chosen & (action < self.cfg.replace_mask)
        to_random = chosen & ~to_mask & (action < self.cfg.replace_mask + self.cfg.replace_random)
        masked = torch.where(to_mask, self.mask_id, ids)
        masked = torch.where(to_random, self.replacements[draw], masked)
        labels = torch.where(chosen, ids, IGNORE_INDEX)
        # choose() never takes more than this budget, so every chosen token gets a slot.
        return MaskedBatch.from_labels(masked, labels, max_masked(self.cfg.probability, ids.shape[1]))

    def choose(
        self, ids: torch.Tensor, attention_mask: torch.Tensor | None, generator: torch.Generator
    ) -> torch.Tensor:
        """``[batch, seq]`` bool: the tokens to predict (see the module docstring)."""
        batch, seq = ids.shape
        eligible = ~self.special[ids]
        if attention_mask is not None:
            eligible &= attention_mask.bool()
        starts = eligible  # each candidate unit (a token, or a whole word) is named by its first position
        if self.continuations is not None:
            previous_eligible = F.pad(eligible[:, :-1], (1, 0), value=False)
            starts = eligible & ~(self.continuations[ids] & previous_eligible)
        positions = torch.arange(seq, device=ids.device).expand(batch, seq)
        start_of = torch.where(starts, positions, 0).cummax(dim=1).values  # each token's unit

        key = -torch.empty(ids.shape, device=ids.device).exponential_(generator=generator).log()
        if self.log_weight is not None:
            piece_weight = self.log_weight[ids].masked_fill(~eligible, -math.inf)
            unit_weight = torch.full_like(key, -math.inf).scatter_reduce(1, start_of, piece_weight, "amax")
            key = key + unit_weight
        key = key.masked_fill(~starts, -math.inf)
        unit_length = torch.zeros_like(key).scatter_add(1, start_of, eligible.float())

        budget = (
            self.cfg.probability * eligible.sum(1) + torch.rand(batch, device=ids.device, generator=generator)
        ).floor()
        order = key.argsort(dim=1, descending=True)
        fits = (unit_length.gather(1, order).cumsum(1) <= budget[:, None]) & starts.gather(1, order)
        taken = torch.zeros_like(starts).scatter(1, order, fits)
        return taken.gather(1, start_of) & eligible
