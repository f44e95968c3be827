"""benchmarks/distill_step.py --profile-steps: where a step's time goes (the GPU campaign's first measurement).

On CPU the profile is the ops' own CPU time; the CUDA branch (kernels, busy share) runs in the campaign.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.distill_step import profile_steps
from trainer.runtime.profiling import op_category, profile_markdown


@pytest.mark.parametrize(
    ("name", "category"),
    [
        ("aten::addmm", "matmul"),
        ("aten::mm", "matmul"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32", "matmul"),
        ("aten::_scaled_dot_product_flash_attention", "attention"),
        ("aten::_scaled_dot_product_efficient_attention_backward", "attention"),
        ("aten::_log_softmax", "softmax and losses"),
        ("aten::kl_div", "softmax and losses"),
        ("aten::index_select", "masking and gathers"),
        ("aten::native_layer_norm_backward", "norms and activations"),
        ("aten::_fused_adamw_", "optimizer"),
        ("aten::copy_", "copies and casts"),
        ("Memcpy HtoD (Pageable -> Device)", "copies and casts"),
        ("aten::add", "other"),
        # a compiled step's kernels, by the names Inductor gives them (recorded so on CUDA)
        ("triton_per_fused__log_softmax_mul_sub_4", "softmax and losses"),
        ("triton_red_fused_add_native_dropout_native_layer_norm_7", "norms and activations"),
        (
            "## Call CompiledFxGraph fgi2a6fdjnmevljv5fpzyhlngtnr22zyatr2c46vw72edcfpnadt ##",
            "compiled graph, unattributed",
        ),
    ],
)
def test_ops_fall_into_the_category_an_optimisation_would_target(name: str, category: str) -> None:
    assert op_category(name) == category


def test_a_profiled_step_accounts_for_its_matmuls_and_softmax_without_counting_twice() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 512)
    optimizer = torch.optim.AdamW(layer.parameters())
    x = torch.randn(64, 256)

    def step(i: int) -> None:
        loss = torch.log_softmax(layer(x), -1).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    profile = profile_steps(step, 0, 3, torch.device("cpu"))
    assert profile["steps"] == 3 and profile["time"] == "cpu"
    categories = profile["categories_ms_per_step"]
    assert categories["matmul"] > 0 and categories["softmax and losses"] > 0
    # Self times: the categories add up to no more than the wall time each thread had (no double counting).
    assert sum(categories.values()) <= profile["wall_ms_per_step"] * torch.get_num_threads() * 1.05
    top = {name: calls for name, _, calls in profile["top_ops"]}
    assert top.get("aten::addmm") == 1  # one forward matmul per step: calls are counted per step
    table = profile_markdown(profile)
    assert all(f"| {category} | " in table for category in categories)
    # the ten costliest ops, whichever they are: the matmul (0.4-0.8 ms a step here) ranks among AdamW's
    # elementwise ops by noise, and a loaded machine once pushed it out of the ten
    assert all(f"| `{name}` | " in table for name, _, _ in profile["top_ops"][:10])
