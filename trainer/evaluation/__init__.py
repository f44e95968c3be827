"""How good a finished model is: the evaluation suite (fine-tuned or probed), held-out masked LM, their statistics."""
