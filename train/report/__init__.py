"""What a run reports: metrics and TensorBoard, MLflow tracking, the evaluation report's figure."""
