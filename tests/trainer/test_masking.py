"""Dynamic masking on real text with the real bert-base-uncased tokenizer: rates, exclusions, reproducibility."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import PreTrainedTokenizerFast

from common.config import ConfigError
from common.tokenizer import load_tokenizer
from trainer.config import MaskingConfig
from trainer.objective.masking import DynamicMasker, max_masked, seeded_generator, word_continuations

ROBERTA_SPECIALS = {
    "bos": "<s>",
    "cls": "<s>",
    "pad": "<pad>",
    "eos": "</s>",
    "sep": "</s>",
    "unk": "<unk>",
    "mask": "<mask>",
}

SEQ = 128


@pytest.fixture(scope="module")
def tokenizer(bert_tokenizer_dir: Path) -> Any:
    return load_tokenizer(str(bert_tokenizer_dir))


def read_texts(corpus: Path) -> list[str]:
    with gzip.open(corpus, "rt", encoding="utf-8") as lines:
        return [json.loads(line)["text"] for line in lines]


def token_stream(tokenizer: Any, texts: list[str]) -> list[int]:
    """The texts as one token stream, documents separated by [SEP] (as the dataset packs them)."""
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.sep_token_id]
    return ids


def pack(tokenizer: Any, stream: list[int]) -> torch.Tensor:
    """Packed [CLS] + 127-token sequences; the last one padded, as the last sequence of a shard may be."""
    body = SEQ - 1
    rows = [[tokenizer.cls_token_id, *stream[i : i + body]] for i in range(0, len(stream), body)]
    rows[-1] += [tokenizer.pad_token_id] * (SEQ - len(rows[-1]))
    return torch.tensor(rows)


@pytest.fixture(scope="module")
def stream(tokenizer: Any, sample_corpus: Path) -> list[int]:
    return token_stream(tokenizer, read_texts(sample_corpus))


@pytest.fixture(scope="module")
def packed(tokenizer: Any, stream: list[int]) -> torch.Tensor:
    return pack(tokenizer, stream)


@pytest.fixture(scope="module")
def byte_level(sample_corpus: Path) -> tuple[Any, torch.Tensor]:
    """A RoBERTa-style byte-level BPE tokenizer trained on the sample corpus, and the corpus packed with it."""
    texts = read_texts(sample_corpus)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=1000, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        **{f"{role}_token": token for role, token in ROBERTA_SPECIALS.items()},
    )
    return tokenizer, pack(tokenizer, token_stream(tokenizer, texts))


@pytest.fixture(scope="module")
def counts(tokenizer: Any, stream: list[int]) -> np.ndarray:
    return np.bincount(np.array(stream), minlength=len(tokenizer)).astype(np.int64)


def draw(masker: DynamicMasker, batch: torch.Tensor, *entropy: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(masked input ids, labels)`` of one draw."""
    out = masker(batch, None, seeded_generator(*entropy))
    return out.input_ids, out.labels


def test_rates_over_many_tokens(tokenizer: Any, packed: torch.Tensor) -> None:
    masker = DynamicMasker.from_tokenizer(MaskingConfig(), tokenizer)
    special = torch.tensor(tokenizer.all_special_ids)
    eligible = ~torch.isin(packed, special)
    chosen = replaced_mask = replaced_random = kept = 0
    for step in range(4):  # 4 x 70k tokens
        masked, labels = draw(masker, packed, 0, step, 0)
        hit = labels != -100
        assert torch.equal(labels[hit], packed[hit])
        chosen += hit.sum().item()
        replaced_mask += (masked[hit] == tokenizer.mask_token_id).sum().item()
        kept += (masked[hit] == packed[hit]).sum().item()
        replaced_random += ((masked[hit] != packed[hit]) & (masked[hit] != tokenizer.mask_token_id)).sum().item()
        assert not torch.isin(masked[hit & (masked != tokenizer.mask_token_id)], special).any()  # no random special
        assert torch.equal(masked[~hit], packed[~hit])
        # Each sequence: its own share of its real tokens, within the fixed budget the Distiller gathers.
        per_row = hit.sum(1).float() / eligible.sum(1)
        assert per_row[:-1].sub(0.15).abs().max() < 1.5 / 127
        assert hit.sum(1).max() <= max_masked(0.15, SEQ)
    assert chosen / (4 * eligible.sum().item()) == pytest.approx(0.15, abs=0.002)
    assert replaced_mask / chosen == pytest.approx(0.8, abs=0.01)
    assert replaced_random / chosen == pytest.approx(0.1, abs=0.01)
    assert kept / chosen == pytest.approx(0.1, abs=0.01)


def test_special_and_padding_tokens_are_never_chosen(tokenizer: Any, packed: torch.Tensor) -> None:
    masker = DynamicMasker.from_tokenizer(MaskingConfig(probability=0.9), tokenizer)
    batch = packed.clone()
    batch[:, 60:] = tokenizer.pad_token_id  # heavy padding
    batch[:, 10] = tokenizer.unk_token_id
    for step in range(4):
        _, labels = draw(masker, batch, 0, step, 0)
        hit = labels != -100
        assert not torch.isin(batch[hit], torch.tensor(tokenizer.all_special_ids)).any()
        assert not hit[:, 60:].any() and not hit[:, 0].any()
        assert hit.any()


def test_padding_is_excluded_by_attention_mask_alone(tokenizer: Any, packed: torch.Tensor) -> None:
    masker = DynamicMasker.from_tokenizer(MaskingConfig(), tokenizer)
    mask = torch.ones_like(packed)
    mask[:, 100:] = 0
    labels = masker(packed, mask, seeded_generator(1)).labels
    assert (labels[:, 100:] == -100).all()


def test_reproducible_from_seed_step_rank(tokenizer: Any, packed: torch.Tensor, counts: np.ndarray) -> None:
    cfg = MaskingConfig(whole_word=True, frequency_smoothing=0.7)
    masker = DynamicMasker.from_tokenizer(cfg, tokenizer, token_counts=counts)
    first = draw(masker, packed, 7, 3, 1)
    assert all(torch.equal(a, b) for a, b in zip(first, draw(masker, packed, 7, 3, 1), strict=True))
    for other in [(7, 4, 1), (7, 3, 0), (8, 3, 1)]:
        assert not torch.equal(first[1], draw(masker, packed, *other)[1])


def test_frequency_smoothing_shifts_selection_toward_rare_tokens(
    tokenizer: Any, packed: torch.Tensor, counts: np.ndarray
) -> None:
    log_counts = torch.as_tensor(np.log(np.maximum(counts, 1)))
    plain = DynamicMasker.from_tokenizer(MaskingConfig(), tokenizer)
    smoothed = DynamicMasker.from_tokenizer(MaskingConfig(frequency_smoothing=0.7), tokenizer, token_counts=counts)
    frequent = torch.as_tensor(counts)[packed] >= np.quantile(counts[counts > 0], 0.99)

    def stats(masker: DynamicMasker) -> tuple[float, float, float]:
        _, labels = draw(masker, packed, 0, 0, 0)
        hit = labels != -100
        return log_counts[packed[hit]].mean().item(), frequent[hit].float().mean().item(), hit.sum().item()

    plain_log, plain_frequent, plain_n = stats(plain)
    smooth_log, smooth_frequent, smooth_n = stats(smoothed)
    assert plain_n == pytest.approx(smooth_n, rel=0.02)  # same budget, different choice
    assert smooth_log < plain_log - 1.0  # the chosen tokens are much rarer on average
    assert smooth_frequent < 0.5 * plain_frequent


@pytest.mark.parametrize("kind", ["wordpiece", "byte-level"])
def test_whole_word_masking_masks_whole_words(
    kind: str, tokenizer: Any, packed: torch.Tensor, byte_level: tuple[Any, torch.Tensor]
) -> None:
    if kind == "byte-level":
        tokenizer, packed = byte_level
    masker = DynamicMasker.from_tokenizer(MaskingConfig(whole_word=True), tokenizer)
    real = ~torch.isin(packed, torch.tensor(tokenizer.all_special_ids))
    # A "##" piece (or a piece without the "Ġ" space) continues the word before it, unless a special token
    # ([CLS], [SEP]) stands there.
    continuation = word_continuations(tokenizer)[packed] & real & torch.nn.functional.pad(real[:, :-1], (1, 0))
    multi_piece_words = 0
    total = eligible = 0
    for step in range(4):
        _, labels = draw(masker, packed, 0, step, 0)
        hit = labels != -100
        # A continuation is chosen exactly when the token before it (same word) is.
        assert torch.equal(hit[:, 1:][continuation[:, 1:]], hit[:, :-1][continuation[:, 1:]])
        multi_piece_words += (hit[:, 1:] & continuation[:, 1:]).sum().item()
        assert hit.sum(1).max() <= max_masked(0.15, SEQ)
        total += hit.sum().item()
        eligible += real.sum().item()
    assert multi_piece_words > 100
    # Words that would overflow a sequence's budget are not taken: slightly under 15% with long words.
    assert 0.13 < total / eligible <= 0.15


def test_word_continuations_follow_wordpiece(tokenizer: Any) -> None:
    table = word_continuations(tokenizer)
    ids = tokenizer("tokenization", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1 and not table[ids[0]] and table[ids[1:]].all()


def test_smoothing_without_counts_is_a_config_error(tokenizer: Any) -> None:
    with pytest.raises(ConfigError, match=r"masking\.frequency_smoothing"):
        DynamicMasker.from_tokenizer(MaskingConfig(frequency_smoothing=0.7), tokenizer)
    with pytest.raises(ConfigError, match=r"masking\.frequency_smoothing"):
        DynamicMasker.from_tokenizer(MaskingConfig(frequency_smoothing=0.7), tokenizer, token_counts=np.ones(5))


@pytest.mark.parametrize(
    "cfg",
    [MaskingConfig(), MaskingConfig(probability=0.4, whole_word=True), MaskingConfig(frequency_smoothing=0.7)],
    ids=["uniform", "whole-word", "smoothed"],
)
def test_positions_hold_every_chosen_token_within_the_budget(
    cfg: MaskingConfig, tokenizer: Any, packed: torch.Tensor, counts: np.ndarray
) -> None:
    """The masker owns the budget: its [batch, budget] positions are every chosen token, none dropped."""
    masker = DynamicMasker.from_tokenizer(cfg, tokenizer, token_counts=counts)
    budget = max_masked(cfg.probability, SEQ)
    for step in range(4):
        out = masker(packed, None, seeded_generator(0, step, 0))
        hit = out.labels != -100
        assert out.positions.index.shape == out.targets.shape == (packed.shape[0], budget)
        assert torch.equal(out.positions.valid.sum(1), hit.sum(1))  # no chosen token without a slot
        assert hit.gather(1, out.positions.index)[out.positions.valid].all()  # valid slots point at chosen tokens
        assert torch.equal(out.targets[out.positions.valid], packed.gather(1, out.positions.index)[out.positions.valid])


def test_a_masked_batch_moves_whole(tokenizer: Any, packed: torch.Tensor) -> None:
    """``to(device)`` moves every tensor (evaluate-mlm masks on the CPU, then scores on the GPU); the meta
    device shows each one moved without a GPU here."""
    out = DynamicMasker.from_tokenizer(MaskingConfig(), tokenizer)(packed, None, seeded_generator(0))
    moved = out.to(torch.device("meta"))
    tensors = [moved.input_ids, moved.labels, moved.targets, moved.positions.index, moved.positions.valid]
    assert all(t.is_meta for t in tensors)
    assert [t.shape for t in tensors] == [
        t.shape for t in (out.input_ids, out.labels, out.targets, *vars(out.positions).values())
    ]
