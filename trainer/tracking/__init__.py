"""MLflow: tracking runs, the registry of students, pulling one. Imports neither DeepSpeed nor the training side."""
