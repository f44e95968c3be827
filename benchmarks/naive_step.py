"""The naive reference step: DistilBERT's objective written the way common distillation scripts write it.

    python benchmarks/distill_step.py CONFIG.yaml --step naive [the other distill_step.py options]

``benchmarks/distill_step.py`` times it on the same models, the same batches and the same device as
the project's step (``--step project``, the default), so that the ratio of the two tokens/s is the
speed-up this project's step brings over the usual way. It is what such scripts do, on purpose:

* masking on the host: the batch stays on the CPU, the 15 % / 80-10-10 choice is made there with
  boolean indexing, and the corrupted ids and labels are copied to the device each micro-step;
* full ``[batch, seq, vocab]`` logits for the teacher and the student (the vocabulary projection at
  every position), then boolean indexing of the masked positions, which waits for the device to
  learn how many there are;
* float32 weights for the teacher and the student, both run under autocast in the training dtype
  (``deepspeed.precision``: bf16 or fp16; none in fp32);
* ``.item()`` on every loss term every micro-step, for logging: one more wait for the device each;
* ``torch.optim.AdamW`` with its defaults (not fused), eager mode.

What it shares with the project's step, so that the ratio measures the recipe and not a handicap (issue
52): the teacher runs in the same 16-bit dtype as the project's (under autocast here, with 16-bit weights
there); it used to run in float32 with TF32 off, at least ~58 of its ~135 ms a step on an H200. And the
gradients are clipped the same way as in every step ``distill_step.py`` times and as the engine does
(DeepSpeed's ``gradient_clipping``): their global norm to ``optimizer.grad_clip`` (``step_parts.clip_gradients``;
0 turns it off for all of them).

Only the output-level terms of DistilBERT (``objective.ce``, ``mlm``, ``cos``) are implemented: a
config with layer terms is refused.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.step_parts import clip_gradients, refuse_layer_terms, torch_adamw, training_autocast
from trainer.config import TrainConfig


class NaiveStep:
    """One optimizer step of the naive recipe on a host batch; returns the logged floats."""

    def __init__(self, cfg: TrainConfig, teacher: Any, student: Any, tokenizer: Any, device: torch.device) -> None:
        refuse_layer_terms(cfg, "the naive step")
        self.cfg, self.device = cfg, device
        self.teacher = teacher.float().to(device).eval()  # float32 weights, as most scripts leave them
        self.student = student.to(device).train()
        self.mask_id, self.vocab = tokenizer.mask_token_id, len(tokenizer)
        self.special = torch.tensor(tokenizer.all_special_ids)
        self.optimizer = torch_adamw(self.student, cfg)
        self.autocast = training_autocast(cfg, device)

    def mask_on_host(self, input_ids: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(corrupted ids, labels with -100 where nothing is predicted), both still on the CPU."""
        m = self.cfg.masking
        ids = input_ids.clone()
        probability = torch.full(ids.shape, m.probability)
        probability[torch.isin(ids, self.special)] = 0.0
        chosen = torch.bernoulli(probability, generator=generator).bool()
        labels = ids.clone()
        labels[~chosen] = -100
        draw = torch.rand(ids.shape, generator=generator)
        ids[chosen & (draw < m.replace_mask)] = self.mask_id
        random = chosen & (draw >= m.replace_mask) & (draw < m.replace_mask + m.replace_random)
        ids[random] = torch.randint(self.vocab, (int(random.sum()),), generator=generator)
        return ids, labels

    def forward_backward(self, input_ids: torch.Tensor, generator: torch.Generator) -> dict[str, float]:
        return self.masked_forward_backward(*self.mask_on_host(input_ids, generator))

    def masked_forward_backward(self, ids: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """The forward and backward of a host batch masked already (``ids``, ``labels``): the logged floats."""
        obj = self.cfg.objective
        ids, labels = ids.to(self.device), labels.to(self.device)
        attention = (ids != 0).long()  # every script passes a mask, padding or not
        with torch.no_grad(), self.autocast:  # the teacher in the training dtype too, as the project's runs
            t_out = self.teacher(input_ids=ids, attention_mask=attention, output_hidden_states=True)
        with self.autocast:
            s_out = self.student(input_ids=ids, attention_mask=attention, output_hidden_states=True)
        s_logits, t_logits = s_out.logits.float(), t_out.logits.float()  # [batch, seq, vocab] each
        selected = labels != -100
        terms: dict[str, torch.Tensor] = {}
        if obj.ce > 0:
            s_sel = s_logits[selected].view(-1, self.vocab)  # boolean indexing: waits for the device
            t_sel = t_logits[selected].view(-1, self.vocab)
            t = obj.temperature
            terms["ce"] = (
                F.kl_div(F.log_softmax(s_sel / t, dim=-1), F.softmax(t_sel / t, dim=-1), reduction="batchmean") * t**2
            )
        if obj.mlm > 0:
            terms["mlm"] = F.cross_entropy(s_logits.view(-1, self.vocab), labels.view(-1), ignore_index=-100)
        if obj.cos > 0:
            keep = attention.bool()
            s_h, t_h = s_out.hidden_states[-1][keep].float(), t_out.hidden_states[-1][keep].float()
            target = torch.ones(s_h.shape[0], device=self.device)
            terms["cos"] = F.cosine_embedding_loss(s_h, t_h, target)
        loss = sum(getattr(obj, name) * value for name, value in terms.items())
        loss.backward()
        logged = {name: value.item() for name, value in terms.items()}  # one wait per term
        logged["loss"] = loss.item()
        return logged

    def __call__(self, input_ids: torch.Tensor, generator: torch.Generator) -> dict[str, float]:
        logged = self.forward_backward(input_ids, generator)
        clip_gradients(self.student.parameters(), self.cfg)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return logged
