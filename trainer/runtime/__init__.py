"""Running the step at scale: DeepSpeed, data, checkpoints, schedule, metrics, evaluation."""
