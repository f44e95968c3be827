"""Teacher -> student masked-LM distillation on DeepSpeed ZeRO."""
