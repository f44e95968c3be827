"""HostReads finds on a CPU the reads that would make a GPU step wait; attention_bias avoids Hugging Face's."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, BertModel

from trainer.modeling import attention_bias
from trainer.runtime.host_reads import HostReadError, HostReads


def test_reads_are_counted_at_the_line_that_asks_for_them() -> None:
    x = torch.arange(6.0)
    with HostReads() as reads:
        x.sum().item()  # one
        if (x > 2).any():  # two: bool() of a tensor
            x.nonzero()  # three: its size depends on the data
        torch.repeat_interleave(x, torch.full((6,), 2), output_size=12)  # sized: no read
        x * 2 + 1  # arithmetic stays on the device
    assert sum(reads.sites.values()) == 3
    assert all(site.startswith(f"{__file__}:") for site in reads.sites)


def test_fail_raises_at_the_first_read_and_names_it() -> None:
    with pytest.raises(HostReadError, match=r"_local_scalar_dense.*test_host_reads\.py"), HostReads(fail=True):
        float(torch.ones(2).sum())


@pytest.fixture(scope="module")
def encoder() -> BertModel:
    config = BertConfig(vocab_size=200, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    return BertModel._from_config(config, attn_implementation="sdpa").eval()


def test_a_padded_batch_through_attention_bias_is_read_nowhere_and_unchanged(encoder: BertModel) -> None:
    ids = torch.randint(5, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 10:] = 0
    with HostReads() as plain:  # Hugging Face asks whether a 2-D mask masks anything
        expected = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
    assert len(plain.sites) == 1 and "masking_utils" in next(iter(plain.sites))
    with HostReads(fail=True):
        hidden = encoder(input_ids=ids, attention_mask=attention_bias(mask)).last_hidden_state
        hidden.sum().backward()
    assert torch.equal(hidden, expected)
    assert attention_bias(None) is None
