"""The real peer: DistilBERT's objective through TextBrewer, the PyPI distillation library a user would pick instead.

    python benchmarks/distill_step.py CONFIG.yaml --step peer [the other distill_step.py options]

``benchmarks/distill_step.py`` times it on the same teacher, student, batches and device as the project's step
(``--step project``) and the naive one (``--step naive``): the ratio of tokens/s is what this project's step
brings over what a user would otherwise install (issue 52). TextBrewer (``textbrewer==0.2.1.post1``, an sdist
on PyPI; HFL's toolkit for distilling transformers, with DistilBERT's cosine loss among its presets) stays
installed, never copied here: on the GPU machine it is a carried wheel (``benchmarks/gpu/wheels.sh``), here
``pip install textbrewer==0.2.1.post1``. It imports ``numpy``, ``tqdm`` and a TensorBoard ``SummaryWriter``
(``tensorboardX``, else ``torch.utils.tensorboard`` and ``tensorboard``), which the GPU machine has.
torchdistill 1.1.5, the other candidate, needs torch >= 2.12 and torchvision >= 0.27; the GPU machine has
torch 2.11 and torchvision 0.26.

How it is set up, as TextBrewer's documentation sets up a distillation:

* ``GeneralDistiller`` with ``DistillationConfig(temperature=T, kd_loss_type="ce", kd_loss_weight=ce x T^2,
  hard_label_weight=mlm, intermediate_matches=[last hidden state, "cos", weight cos])``. Its soft
  cross-entropy (``kd_ce_loss``) is the project's KL divergence plus the teacher's entropy, which has no
  gradient, and it has no T^2 factor: hence the weight. Its ``cos`` match is DistilBERT's
  ``cosine_embedding_loss`` over the real tokens (``inputs_mask``).
* The adaptors return the logits, the hidden states, the attention mask and, as ``logits_mask``, the masked
  positions (``objective.ce_positions=masked``; ``all``: every real token); the student's adaptor returns
  transformers' own masked-LM loss (the model called with ``labels``) as the hard-label loss.
* The batches are masked by transformers' ``DataCollatorForLanguageModeling`` (``masking.probability``,
  ``replace_mask``, ``replace_random``; uniform, so without the DistilBERT preset's frequency smoothing)
  before the timing, as a ``DataLoader``'s workers would, so the masking costs the peer nothing; the
  copy to the device is TextBrewer's own (``move_to_device``), each step.
* bf16 (or fp16): TextBrewer's own mixed precision is apex's fp16, which the GPU machine lacks, so its
  ``train_on_batch`` runs under ``torch.autocast`` in the training dtype, float32 weights for both models:
  the teacher in the same 16-bit dtype as the project's, as in the naive step.
* The step is the body of TextBrewer's ``train_with_num_steps`` loop: ``train_on_batch``, ``write_loss``
  (``.item()`` of every term, TensorBoard off: ``log_dir=None``), ``backward``, the gradients clipped to
  ``optimizer.grad_clip`` (its ``max_grad_norm``, as the other steps clip), ``torch.optim.AdamW`` with
  the config's settings (torch's default implementation, as the naive step), ``zero_grad``. Not its
  ``train`` itself, which also saves the student at the last step: a checkpoint inside the timing.

Only the output-level terms of DistilBERT (``objective.ce``, ``mlm``, ``cos``) are configured: a config with
layer terms or ``mse`` is refused.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from benchmarks.step_parts import clip_gradients, refuse_layer_terms, torch_adamw, training_autocast
from common.config import ConfigError
from trainer.config import TrainConfig

PEER = "textbrewer"
PEER_VERSION = "0.2.1.post1"


def load_textbrewer() -> Any:
    try:
        import textbrewer
    except ImportError as err:
        raise ConfigError(
            f"--step peer needs {PEER}=={PEER_VERSION} installed (pip install {PEER}=={PEER_VERSION}; on the GPU "
            f"machine the carried wheel, benchmarks/gpu/wheels.sh): {err}"
        ) from None
    return textbrewer


def distillation_config(cfg: TrainConfig, teacher_layers: int, student_layers: int) -> dict[str, Any]:
    """TextBrewer's ``DistillationConfig`` arguments for the config's DistilBERT terms."""
    obj = cfg.objective
    matches = []
    if obj.cos > 0:  # hidden_states[n] is the last layer's output ([0] is the embeddings)
        last = {"layer_T": teacher_layers, "layer_S": student_layers, "feature": "hidden"}
        matches.append({**last, "loss": "cos", "weight": obj.cos})
    return {
        "temperature": obj.temperature,
        "kd_loss_type": "ce",
        "kd_loss_weight": obj.ce * obj.temperature**2,  # kd_ce_loss has no T^2 factor
        "hard_label_weight": obj.mlm,
        "intermediate_matches": matches,
    }


class PeerStep:
    """One optimizer step of TextBrewer's loop on the ``i``-th of the pre-masked host batches."""

    def __init__(
        self,
        cfg: TrainConfig,
        teacher: Any,
        student: Any,
        tokenizer: Any,
        device: torch.device,
        host_batches: list[torch.Tensor],
    ) -> None:
        refuse_layer_terms(cfg, "the peer step")
        if cfg.objective.mse > 0:
            raise ConfigError("objective.mse: the peer step is configured for DistilBERT's output terms only")
        textbrewer = load_textbrewer()
        from transformers import DataCollatorForLanguageModeling

        self.cfg, self.device = cfg, device
        self.teacher = teacher.float().to(device).eval()
        self.student = student.float().to(device).train()
        m = cfg.masking
        collator = DataCollatorForLanguageModeling(
            tokenizer,
            mlm_probability=m.probability,
            mask_replace_prob=m.replace_mask,
            random_replace_prob=m.replace_random,
            seed=cfg.seed,
        )
        self.batches = []
        for ids in host_batches:  # what a DataLoader(collate_fn=collator) yields, on the host
            masked = collator([{"input_ids": row} for row in ids])
            inputs = {"input_ids": masked["input_ids"], "attention_mask": masked["attention_mask"]}
            self.batches.append({"teacher": inputs, "student": {**inputs, "labels": masked["labels"]}})
        optimizer = torch_adamw(self.student, cfg)
        self.distiller = textbrewer.GeneralDistiller(
            train_config=textbrewer.TrainingConfig(device=device, log_dir=None, output_dir=tempfile.mkdtemp()),
            distill_config=textbrewer.DistillationConfig(
                **distillation_config(cfg, teacher.config.num_hidden_layers, student.config.num_hidden_layers)
            ),
            model_T=self.teacher,
            model_S=self.student,
            adaptor_T=self.adaptor,
            adaptor_S=self.adaptor,
        )
        self.optimizer, _, _ = self.distiller.initialize_training(optimizer, None, None, None)
        self.autocast = training_autocast(cfg, device)
        self.logits_mask: torch.Tensor | None = None
        self.steps = 0

    def adaptor(self, batch: dict[str, torch.Tensor], outputs: Any) -> dict[str, Any]:
        """TextBrewer's adaptor, the same for teacher and student: what its losses read from a model's output."""
        result = {
            "logits": outputs.logits,
            "hidden": outputs.hidden_states,
            "inputs_mask": batch["attention_mask"],
            "logits_mask": self.logits_mask,
        }
        if outputs.loss is not None:  # the student's, called with the labels: the MLM loss
            result["losses"] = outputs.loss
        return result

    def forward_backward(self, i: int) -> torch.Tensor:
        batch = self.batches[i % len(self.batches)]
        if self.cfg.objective.ce_positions == "masked":
            self.logits_mask = (batch["student"]["labels"] != -100).to(self.device)
        else:
            self.logits_mask = batch["teacher"]["attention_mask"].bool().to(self.device)
        with self.autocast:
            total_loss, losses = self.distiller.train_on_batch(batch, {"output_hidden_states": True})
        self.distiller.write_loss(total_loss, self.steps, losses)  # .item() of each term, as its loop does
        self.steps += 1
        total_loss.backward()
        return total_loss.detach()

    def __call__(self, i: int) -> torch.Tensor:
        loss = self.forward_backward(i)
        clip_gradients(self.student.parameters(), self.cfg)  # TextBrewer's max_grad_norm
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss
