"""A student on a labelled task: fine-tuning, and task-specific distillation from a fine-tuned teacher."""
